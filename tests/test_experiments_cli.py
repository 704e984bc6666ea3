"""`specdec ab run/report/export` end to end on a tiny random model, and the arms-file loader."""

from __future__ import annotations

import csv
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from experiments.offline import load_definition
from experiments.store import RecordStore
from specdec.cli import main

PNGS = ("arms.png", "positions.png", "tpot.png", "sequence.png")
PROMPTS = ['{"text": "t3 t4 t5 t6 t3 t4 t5 t6 t3 t4"}', '{"text": "t7 t8 t9 t7 t8 t9 t7 t8"}',
           '{"prompt": "t2 t2 t2 t2 t2 t2"}']


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(PROMPTS) + "\n")
    return p


def _arms(tmp_path: Path, design: str, yaml: bool = False) -> Path:
    arms = {"control": {"method": "none"}, "ngram": {"method": "ngram", "k": 3}}
    if yaml:
        p = tmp_path / "arms.yaml"
        p.write_text(f"name: sb\ndesign: {design}\narms:\n  control: {{method: none}}\n"
                     "  ngram: {method: ngram, k: 3}\nweights: {control: 1, ngram: 1}\n")
        return p
    p = tmp_path / "arms.json"
    p.write_text(json.dumps({"name": "ng", "arms": arms, "control": "control",
                             "weights": {"control": 1, "ngram": 3}, "design": design}))
    return p


def _is_png(p: Path) -> bool:
    return p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ab_run_request_design_then_report_and_export(tiny_llama, data, tmp_path, capsys):
    out = tmp_path / "out"
    # Fixed depths: on a random model the goodput controller may rightly choose depth 0,
    # depending on this machine's step costs, and the n-gram arm would then draft nothing.
    rc = main(["ab", "run", "--data", str(data), "--arms", str(_arms(tmp_path, "request")),
               "--model", str(tiny_llama), "--max-tokens", "12", "--ignore-eos",
               "--no-adaptive-speculation", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ngram" in text and "not comparable" in text
    assert all(_is_png(out / n) for n in PNGS)
    s = json.loads((out / "summary.json").read_text())
    assert {a: s["arms"][a]["requests"] for a in s["arms"]} == {"control": 3, "ngram": 3}
    assert s["arms"]["control"]["tau"]["estimate"] == 1.0
    assert s["arms"]["control"]["draft_tokens"] == 0
    ng = s["arms"]["ngram"]
    assert ng["draft_tokens"] > 0 and 0 <= ng["accepted_tokens"] <= ng["draft_tokens"]
    assert ng["output_tokens"] == 36  # 3 prompts x 12 tokens, as the control
    assert not s["srm"]["flagged"]  # every arm saw every prompt, whatever the file's weights

    db = out / "records.sqlite"
    with RecordStore(db) as store:
        records = store.records("ng")
        assert store.experiment("ng")["design"] == "request"
    assert sorted(r.unit for r in records) == sorted([f"prompt-{i}" for i in range(3)] * 2)
    again = tmp_path / "again"
    assert main(["ab", "report", "--db", str(db), "ng", "--out", str(again)]) == 0
    assert json.loads((again / "summary.json").read_text()) == s

    csv_path = tmp_path / "ng.csv"
    assert main(["ab", "export", "--db", str(db), "ng", "-o", str(csv_path)]) == 0
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 6 and {r["arm"] for r in rows} == {"control", "ngram"}
    # A second run into the same file would mix two runs' records: refused.
    assert main(["ab", "run", "--data", str(data), "--arms", str(_arms(tmp_path, "request")),
                 "--model", str(tiny_llama), "--db", str(db), "--out", str(out)]) == 1


def test_ab_run_switchback_from_yaml(tiny_llama, data, tmp_path):
    out = tmp_path / "sb"
    rc = main(["ab", "run", "--data", str(data), "--arms", str(_arms(tmp_path, "switchback",
                                                                     yaml=True)),
               "--model", str(tiny_llama), "--max-tokens", "6", "--ignore-eos", "--slots", "3",
               "--out", str(out)])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["unit"] == "slot"
    # 3 chunks of one prompt, each under both arms: 6 slots, 3 per arm, each timed.
    assert {a: s["arms"][a]["units"] for a in s["arms"]} == {"control": 3, "ngram": 3}
    assert s["arms"]["ngram"]["latency"]["comparable"] is True
    assert s["arms"]["control"]["slots"]["throughput"]["slots"] == 3
    assert s["comparisons"]["ngram"]["latency"]["tpot_s"]["ci"][0] is not None
    assert all(_is_png(out / n) for n in PNGS)


class _Records(BaseHTTPRequestHandler):
    body = b""
    seen: list[str | None] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        ok = self.path == "/v1/experiments/ng/records"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(self.body if ok else b"{}")

    def log_message(self, *args: object) -> None:
        pass


def test_ab_report_from_a_server(tmp_path, monkeypatch):
    recs = [{"experiment": "ng", "arm": arm, "unit": f"u{i}", "request_id": f"{arm}{i}",
             "slot": None, "in_burn_in": False, "finished_at": float(i), "prompt_tokens": 4,
             "output_tokens": 9, "draft_tokens": 0 if arm == "control" else 8,
             "accepted_tokens": 0 if arm == "control" else 3 + i % 3, "steps": 8 - i % 3,
             "accepted_per_position": [], "ttft_s": 0.05, "tpot_s": 0.01}
            for i in range(20) for arm in ("control", "ngram")]
    _Records.body = json.dumps({"records": recs, "experiment": {
        "control": "control", "arms": ["control", "ngram"],
        "weights": {"control": 1, "ngram": 1}, "design": "request"}}).encode()
    server = HTTPServer(("127.0.0.1", 0), _Records)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("SPECDEC_API_KEY", "secret")
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert main(["ab", "report", "--url", url, "ng", "--out", str(tmp_path / "r")]) == 0
        with pytest.raises(SystemExit, match="404"):
            main(["ab", "report", "--url", url, "missing", "--out", str(tmp_path / "m")])
    finally:
        server.shutdown()
    assert _Records.seen[0] == "Bearer secret"
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["arms"]["ngram"]["requests"] == 20
    assert s["comparisons"]["ngram"]["tau"]["lift"] > 0


def test_arms_file_loader(tmp_path):
    p = tmp_path / "many.json"
    p.write_text(json.dumps({"experiments": [
        {"name": "a", "arms": {"control": {"method": "none"}, "x": {"method": "ngram"}}},
        {"name": "b", "arms": {"base": {"method": "none"}, "y": {"method": "ngram", "k": 5}},
         "control": "base", "design": "switchback"}]}))
    a = load_definition(p)
    assert a["name"] == "a" and a["control"] == "control" and a["design"] == "request"
    assert a["weights"] == {"control": 0.5, "x": 0.5}
    b = load_definition(p, "b")
    assert b["arms"]["y"] == {"method": "ngram", "num_speculative_tokens": 5}
    with pytest.raises(ValueError, match="no experiment named"):
        load_definition(p, "c")
    # A single definition, checked as the server checks one: the error names the field.
    for bad, field in [({"arms": {"only": {}}}, "arms"),
                       ({"arms": {"c": {}, "t": {}}, "control": "z"}, "control"),
                       ({"arms": {"c": {}, "t": {}}, "weights": {"q": 1}}, "weights.q"),
                       ({"arms": {"c": {}, "t": {}}, "design": "bandit"}, "design"),
                       ({"arms": {"c": {}, "t": {"method": "ngram", "k": -1}}},
                        "arms.t.num_speculative_tokens")]:
        p.write_text(json.dumps({"name": "e", **bad}))
        with pytest.raises(ValueError, match=rf"^{field}:"):
            load_definition(p)
