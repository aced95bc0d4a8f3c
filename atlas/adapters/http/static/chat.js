// The chat page: a conversation streamed from /v1/chat/completions, a model picker from
// /v1/models, and the bearer token (kept in localStorage) once the server answers 401.
import { readEvents, renderText, splitThinking } from "./stream.js";

const TOKEN_KEY = "atlas.token";
const MODEL_KEY = "atlas.model";
const LOADING_RETRY_MS = 2000;

const $ = (selector) => document.querySelector(selector);
const ui = {
  model: $("#model"),
  auth: $("#auth"),
  token: $("#token"),
  newChat: $("#new-chat"),
  conversation: $("#conversation"),
  hint: $("#hint"),
  status: $("#status"),
  composer: $("#composer"),
  prompt: $("#prompt"),
  send: $("#send"),
  stop: $("#stop"),
};

let history = []; // the {role, content} messages sent with the next question; New chat replaces it
let controller = null; // aborts the answer being streamed; null when none is

class ApiError extends Error {}

function authHeaders() {
  const token = localStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

/** The message of an API error object (or whatever else the body holds), with the status. */
async function describeFailure(response) {
  const text = await response.text();
  let message = text.trim() || response.statusText;
  try {
    message = JSON.parse(text).error?.message ?? message;
  } catch {
    // not JSON: a proxy's page, say; its text is the best there is
  }
  return `${response.status}: ${message}`;
}

function setStatus(text) {
  ui.status.textContent = text;
}

/** Shows the token field after a 401 (`failure`, as describeFailure says it). */
function askForToken(failure) {
  const token = localStorage.getItem(TOKEN_KEY);
  ui.auth.hidden = false;
  ui.token.value = token ?? "";
  ui.token.focus();
  setStatus(token ? `The server refused the token (${failure}): enter another above.`
    : "This server asks for a bearer token: enter it above.");
}

async function loadModels() {
  let response;
  try {
    response = await fetch("v1/models", { headers: authHeaders() });
  } catch (error) {
    setStatus(`Cannot reach the server: ${error.message}`);
    return;
  }
  if (response.status === 401) {
    askForToken(await describeFailure(response));
    return;
  }
  if (response.status === 503) {
    setStatus(`The server is not ready yet (${await describeFailure(response)}); trying again.`);
    setTimeout(loadModels, LOADING_RETRY_MS);
    return;
  }
  if (!response.ok) {
    setStatus(`Cannot list the models: ${await describeFailure(response)}`);
    return;
  }
  const { data } = await response.json();
  const saved = localStorage.getItem(MODEL_KEY);
  ui.model.replaceChildren(...data.map((model) => new Option(model.id, model.id)));
  if (data.some((model) => model.id === saved)) ui.model.value = saved;
  setStatus("");
}

/** One assistant message: its reasoning, its answer, its stats line, as they stream in. */
class Answer {
  constructor() {
    this.element = message("assistant");
    this.element.setAttribute("aria-busy", "true");
    this.reasoningBlock = document.createElement("details");
    this.reasoningBlock.className = "reasoning";
    this.reasoningBlock.hidden = true;
    this.reasoningTitle = document.createElement("summary");
    this.reasoningBody = document.createElement("div");
    this.reasoningBody.className = "reasoning-text";
    this.reasoningBlock.append(this.reasoningTitle, this.reasoningBody);
    this.body = document.createElement("div");
    this.body.className = "answer";
    this.stats = document.createElement("p");
    this.stats.className = "stats";
    this.element.append(this.reasoningBlock, this.body, this.stats);
    this.setState("waiting");

    this.reasoning = ""; // from reasoning_content deltas
    this.content = ""; // raw content deltas, <think> blocks included
    this.answer = "";
    this.chunkTokens = 0; // deltas seen: the count when the server sends no usage until the end
    this.usageTokens = null;
    this.finishReason = null;
    this.sentMs = performance.now();
    this.firstMs = null;
    this.lastMs = null;
    this.frame = null;
  }

  setState(state) {
    this.state = state;
    this.element.dataset.state = state;
  }

  get tokens() {
    return this.usageTokens ?? this.chunkTokens;
  }

  add(chunk) {
    const now = performance.now();
    for (const choice of chunk.choices ?? []) {
      const delta = choice.delta ?? {};
      const reasoning = delta.reasoning_content ?? delta.reasoning ?? "";
      this.reasoning += reasoning;
      this.content += delta.content ?? "";
      if (reasoning || delta.content) {
        this.chunkTokens += 1;
        this.firstMs ??= now;
        this.lastMs = now;
        this.setState("streaming");
      }
      this.finishReason = choice.finish_reason ?? this.finishReason;
    }
    if (chunk.usage) this.usageTokens = chunk.usage.completion_tokens;
    // Chunks can come faster than frames: draw once a frame.
    this.frame ??= requestAnimationFrame(() => {
      this.frame = null;
      this.render();
    });
  }

  finish(state, error) {
    if (this.frame !== null) cancelAnimationFrame(this.frame);
    this.frame = null;
    this.setState(state);
    this.element.removeAttribute("aria-busy");
    this.render();
    if (error) {
      const keepAtBottom = isScrolledDown();
      const note = document.createElement("p");
      note.className = "error";
      note.setAttribute("role", "alert");
      note.textContent = error;
      this.element.append(note);
      if (keepAtBottom) scrollDown();
    }
  }

  render() {
    const keepAtBottom = isScrolledDown();
    const split = splitThinking(this.content);
    const reasoning = this.reasoning + split.reasoning;
    this.answer = split.answer;
    if (reasoning) {
      this.reasoningBlock.hidden = false;
      const thinking = this.state === "streaming" && (split.thinking || !split.answer);
      this.reasoningTitle.textContent = thinking ? "Thinking…" : "Reasoning";
      this.reasoningBody.textContent = reasoning;
    }
    renderText(this.body, this.answer);
    this.stats.textContent = this.describeStats();
    if (keepAtBottom) scrollDown();
  }

  /**
   * "N tokens · R tokens/s · first token after S s". The rate counts the tokens after the
   * first over the time they took, so the prompt's prefill (the wait for the first) is apart.
   */
  describeStats() {
    const parts = [];
    if (this.firstMs === null) {
      if (this.state === "waiting") parts.push("waiting for the first token…");
    } else {
      parts.push(`${this.tokens} ${this.tokens === 1 ? "token" : "tokens"}`);
      const seconds = (this.lastMs - this.firstMs) / 1000;
      if (this.tokens > 1 && seconds > 0) parts.push(`${((this.tokens - 1) / seconds).toFixed(1)} tokens/s`);
      parts.push(`first token after ${((this.firstMs - this.sentMs) / 1000).toFixed(2)} s`);
    }
    if (this.state === "stopped") parts.push("stopped");
    if (this.state === "done" && this.finishReason === "length") parts.push("cut at the length limit");
    return parts.join(" · ");
  }
}

function message(role, text) {
  ui.hint.hidden = true;
  const element = document.createElement("article");
  element.className = `message ${role}`;
  element.setAttribute("aria-label", role === "user" ? "You" : "Model");
  if (text !== undefined) {
    const body = document.createElement("p");
    body.textContent = text;
    element.append(body);
  }
  ui.conversation.append(element);
  scrollDown();
  return element;
}

function isScrolledDown() {
  const c = ui.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight < 48;
}

function scrollDown() {
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

function setStreaming(streaming) {
  ui.send.hidden = streaming;
  ui.stop.hidden = !streaming;
  ui.model.disabled = streaming;
}

async function ask(question) {
  const turns = history; // an answer stopped by New chat lands in the old conversation
  message("user", question);
  turns.push({ role: "user", content: question });
  const answer = new Answer();
  const aborter = new AbortController();
  controller = aborter;
  setStreaming(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model: ui.model.value || undefined,
        messages: turns,
        stream: true,
        stream_options: { include_usage: true, continuous_usage_stats: true },
      }),
      signal: aborter.signal,
    });
    if (!response.ok) {
      const failure = await describeFailure(response);
      if (response.status === 401) askForToken(failure);
      throw new ApiError(`Error ${failure}`);
    }
    for await (const data of readEvents(response)) {
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(`Error: ${chunk.error.message ?? JSON.stringify(chunk.error)}`);
      answer.add(chunk);
    }
    answer.finish("done");
  } catch (error) {
    if (error.name === "AbortError") {
      answer.finish("stopped");
    } else {
      answer.finish("error", error instanceof ApiError ? error.message : `The request failed: ${error.message}`);
    }
  } finally {
    if (controller === aborter) {
      controller = null;
      setStreaming(false);
    }
  }
  // What the model said is context for the next question, a stopped answer's part too; a
  // question that got nothing leaves the history so it is not asked twice.
  if (answer.answer) turns.push({ role: "assistant", content: answer.answer });
  else turns.pop();
  if (document.activeElement === document.body) ui.prompt.focus();
}

function resizePrompt() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 240)}px`;
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const question = ui.prompt.value.trim();
  if (!question || controller) return;
  ui.prompt.value = "";
  resizePrompt();
  ask(question);
});

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  }
});
ui.prompt.addEventListener("input", resizePrompt);

ui.stop.addEventListener("click", () => controller?.abort());

ui.newChat.addEventListener("click", () => {
  controller?.abort();
  controller = null;
  setStreaming(false);
  history = [];
  ui.conversation.replaceChildren(ui.hint);
  ui.hint.hidden = false;
  ui.prompt.focus();
});

ui.model.addEventListener("change", () => localStorage.setItem(MODEL_KEY, ui.model.value));

ui.auth.addEventListener("submit", (event) => {
  event.preventDefault();
  const token = ui.token.value.trim();
  if (token) localStorage.setItem(TOKEN_KEY, token);
  else localStorage.removeItem(TOKEN_KEY);
  setStatus("");
  loadModels();
  ui.prompt.focus();
});

if (localStorage.getItem(TOKEN_KEY)) {
  ui.auth.hidden = false;
  ui.token.value = localStorage.getItem(TOKEN_KEY);
}
loadModels();
