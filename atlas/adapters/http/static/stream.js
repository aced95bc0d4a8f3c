// What the page does with the bytes the API sends, apart from the page itself: server-sent
// events out of a fetch body, <think> blocks out of streamed text, and text into DOM nodes.

/**
 * The `data:` payloads of a server-sent event stream, one string per event, ending at
 * `data: [DONE]` or at the end of the body. Throws what the body's reader throws (an
 * AbortError when the fetch is aborted).
 */
export async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      buffered += decoder.decode(value ?? new Uint8Array(), { stream: !done });
      // An event ends at a blank line; the last piece may be an event still arriving.
      const events = buffered.split(/\r?\n\r?\n/);
      buffered = done ? "" : events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5))
          .join("\n");
        if (data === "[DONE]") return;
        if (data) yield data;
      }
      if (done) return;
    }
  } finally {
    reader.releaseLock();
  }
}

const OPEN = "<think>";
const CLOSE = "</think>";

/** `text` less a trailing piece that may be the start of `tag` still arriving. */
function withoutPartialTag(text, tag) {
  for (let length = Math.min(tag.length - 1, text.length); length > 0; length--) {
    if (text.endsWith(tag.slice(0, length))) return text.slice(0, -length);
  }
  return text;
}

/**
 * Splits raw reasoning out of streamed content: `{reasoning, answer, thinking}`.
 *
 * A model without a server-side reasoning parser writes `<think>...</think>` into its answer;
 * some chat templates open the block in the prompt, so only `</think>` arrives. Called on the
 * whole text so far, so a tag split across chunks is handled: a tag's first characters at the
 * end are held back until the rest shows what they were. `thinking` is true while a block is open.
 */
export function splitThinking(text) {
  const start = text.trimStart();
  if (start.startsWith(OPEN)) {
    const body = start.slice(OPEN.length);
    const end = body.indexOf(CLOSE);
    if (end < 0) return { reasoning: withoutPartialTag(body, CLOSE), answer: "", thinking: true };
    return { reasoning: body.slice(0, end), answer: body.slice(end + CLOSE.length).trimStart(), thinking: false };
  }
  if (start && OPEN.startsWith(start)) return { reasoning: "", answer: "", thinking: false };
  const end = text.indexOf(CLOSE);
  if (end >= 0 && !text.slice(0, end).includes(OPEN)) {
    return { reasoning: text.slice(0, end), answer: text.slice(end + CLOSE.length).trimStart(), thinking: false };
  }
  return { reasoning: "", answer: text, thinking: false };
}

/**
 * Renders model text into `element` as text nodes only (never as markup): ``` fences become
 * <pre><code> blocks (an unclosed one runs to the end, as while it streams), `spans` become
 * <code>, blank lines part paragraphs, and other line breaks are kept through CSS.
 */
export function renderText(element, text) {
  const nodes = [];
  let prose = [];
  let code = null;
  const flushProse = () => {
    for (const text of prose.join("\n").split(/\n\s*\n/)) {
      if (text.trim()) nodes.push(paragraph(text.replace(/^\n+|\s+$/g, "")));
    }
    prose = [];
  };
  for (const line of text.split("\n")) {
    if (line.trimStart().startsWith("```")) {
      if (code === null) {
        flushProse();
        code = [];
      } else {
        nodes.push(codeBlock(code.join("\n")));
        code = null;
      }
    } else if (code !== null) {
      code.push(line);
    } else {
      prose.push(line);
    }
  }
  flushProse();
  if (code !== null) nodes.push(codeBlock(code.join("\n")));
  element.replaceChildren(...nodes);
}

function paragraph(text) {
  const p = document.createElement("p");
  // Odd pieces between backticks are inline code; an unmatched backtick stays as it is.
  const pieces = text.split("`");
  if (pieces.length % 2 === 0) pieces.splice(-2, 2, pieces.at(-2) + "`" + pieces.at(-1));
  pieces.forEach((piece, index) => {
    if (index % 2 === 0) {
      p.append(piece);
    } else {
      const code = document.createElement("code");
      code.textContent = piece;
      p.append(code);
    }
  });
  return p;
}

function codeBlock(text) {
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  code.textContent = text;
  pre.append(code);
  return pre;
}
