import io
import json
from types import SimpleNamespace

from atlas.app.step_trace import StepTrace


class _Core:
    def __init__(self):
        prefill = SimpleNamespace(start_position=0, token_ids=(1, 2, 3), num_draft_tokens=0)
        decode = SimpleNamespace(start_position=9, token_ids=(4,), num_draft_tokens=0)
        verify = SimpleNamespace(start_position=5, token_ids=(5, 6, 7), num_draft_tokens=2)
        self.newest_batch = SimpleNamespace(sequences=(prefill, decode, verify))
        self.scheduler = SimpleNamespace(num_running=3, num_waiting=2)

    def step(self):
        return ["out"]


class _File(io.StringIO):
    def close(self):
        self.closed_value = self.getvalue()
        super().close()


def test_each_step_becomes_a_json_line_with_its_batch():
    file = _File()
    trace = StepTrace(_Core(), file)
    assert trace.step(num_commands=4) == ["out"]
    trace.step(num_commands=0)
    trace.close()
    lines = [json.loads(line) for line in file.closed_value.splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert (first["commands"], first["seqs"], first["tokens"], first["decodes"]) == (4, 3, 7, 2)
    assert (first["outputs"], first["running"], first["waiting"]) == (1, 3, 2)
    assert lines[1]["t"] >= first["t"] and first["dt"] >= 0


def test_the_trace_is_off_unless_the_environment_names_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("ATLAS_STEP_TRACE", raising=False)
    assert StepTrace.from_environment(_Core()) is None
    monkeypatch.setenv("ATLAS_STEP_TRACE", str(tmp_path / "steps.jsonl"))
    trace = StepTrace.from_environment(_Core())
    trace.step(1)
    trace.close()
    assert json.loads((tmp_path / "steps.jsonl").read_text())["seqs"] == 3
