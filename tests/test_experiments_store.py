"""The experiment record store: round trip, CSV export, definitions, appends from many threads
at once, and records that survive a SIGKILLed writer."""

from __future__ import annotations

import csv
import io
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

from experiments.record import RequestRecord
from experiments.store import FIELDS, RecordStore


def rec(i: int, experiment: str = "e", arm: str = "a", **kw) -> RequestRecord:
    base = dict(experiment=experiment, arm=arm, unit=f"user-{i % 7}", request_id=f"r{i}",
                slot=i % 3 if i % 2 else None, in_burn_in=i % 5 == 0, finished_at=1e9 + i,
                prompt_tokens=10 + i, output_tokens=20 + i, draft_tokens=8 + i,
                accepted_tokens=4 + i, steps=5, accepted_per_position=[3, 1, i],
                drafted_per_position=[5, 5, i + 1], ttft_s=0.01 * i if i % 4 else None,
                tpot_s=0.002, finish_reason="length" if i % 2 else "stop")
    return RequestRecord(**{**base, **kw})


def test_round_trip_keeps_every_field(tmp_path: Path):
    records = [rec(i) for i in range(12)] + [rec(i, experiment="other") for i in range(3)]
    with RecordStore(tmp_path / "sub" / "x.sqlite") as store:
        for r in records[::-1]:
            store.append(r)
        assert store.records("e") == sorted(records[:12], key=lambda r: r.finished_at)
        assert store.records("missing") == []
        assert store.experiments() == ["e", "other"]
    with RecordStore(tmp_path / "sub" / "x.sqlite") as again:  # a reopened file reads the same
        got = again.records("e")
    assert got == sorted(records[:12], key=lambda r: r.finished_at)
    assert isinstance(got[0].in_burn_in, bool) and isinstance(got[0].accepted_per_position, list)


def test_wal_mode(tmp_path: Path):
    RecordStore(tmp_path / "w.sqlite").close()
    mode = sqlite3.connect(tmp_path / "w.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_definitions(tmp_path: Path):
    with RecordStore(tmp_path / "d.sqlite") as store:
        assert store.experiment("x") is None
        d = {"arms": {"control": {"method": "none"}, "ng": {"method": "ngram"}},
             "control": "control", "weights": {"control": 1, "ng": 1}, "design": "request"}
        store.save_experiment("x", d)
        assert store.experiment("x") == d
        store.save_experiment("x", {**d, "design": "switchback"})  # replaced
        assert store.experiment("x")["design"] == "switchback"
        assert store.experiments() == ["x"]  # listed before any record arrives


def test_csv_export(tmp_path: Path):
    records = [rec(i) for i in range(5)] + [rec(9, experiment="f")]
    with RecordStore(tmp_path / "c.sqlite") as store:
        for r in records:
            store.append(r)
        buf = io.StringIO()
        assert store.export_csv("e", buf) == 5
        every = io.StringIO()
        assert store.export_csv(None, every) == 6
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert list(rows[0]) == FIELDS
    assert [r["request_id"] for r in rows] == [f"r{i}" for i in range(5)]
    assert rows[1]["accepted_per_position"] == "[3, 1, 1]"
    assert rows[0]["in_burn_in"] == "1" and rows[1]["in_burn_in"] == "0"
    assert rows[0]["ttft_s"] == "" and rows[0]["slot"] == ""  # None is an empty cell
    assert float(rows[1]["ttft_s"]) == 0.01


def test_concurrent_appends_from_threads(tmp_path: Path):
    store = RecordStore(tmp_path / "t.sqlite")
    threads, per = 8, 100
    start = threading.Barrier(threads)

    def writer(k: int) -> None:
        start.wait()
        for j in range(per):
            store.append(rec(k * per + j, arm=f"arm{k}"))
            if j % 25 == 0:
                store.records("e")  # reads interleave with the writes

    ts = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    got = store.records("e")
    store.close()
    assert len(got) == threads * per
    assert sorted(r.request_id for r in got) == sorted(f"r{i}" for i in range(threads * per))


_WRITER = """
import sys
from experiments.record import RequestRecord
from experiments.store import RecordStore
store = RecordStore(sys.argv[1])
i = 0
while True:
    store.append(RequestRecord(experiment="k", arm="a", unit="u", request_id=f"r{i}",
                               slot=None, in_burn_in=False, finished_at=float(i),
                               prompt_tokens=1, output_tokens=2, draft_tokens=3,
                               accepted_tokens=1, steps=1, accepted_per_position=[1]))
    i += 1
    print(i, flush=True)  # acknowledged: append returned
"""


def test_records_survive_a_sigkilled_writer(tmp_path: Path):
    db = tmp_path / "k.sqlite"
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.stdout is not None
    acked = 0
    for line in p.stdout:
        acked = int(line)
        if acked >= 200:
            break
    os.kill(p.pid, signal.SIGKILL)  # mid-loop, with the database open
    p.wait()
    assert p.returncode == -signal.SIGKILL
    with RecordStore(db) as store:
        got = store.records("k")
        assert len(got) >= acked  # every acknowledged append is there
        assert [r.request_id for r in got] == [f"r{i}" for i in range(len(got))]
        store.append(rec(1, experiment="k"))  # and the file takes new writes
        assert len(store.records("k")) == len(got) + 1


def test_a_file_from_an_older_record_gains_the_new_columns(tmp_path: Path):
    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    kept = [f for f in FIELDS if f not in ("drafted_per_position", "finish_reason")]
    con.execute(f"CREATE TABLE records (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                f"{', '.join(kept)})")
    old = rec(3, drafted_per_position=[], finish_reason=None)
    row = {**old.to_dict(), "accepted_per_position": "[3, 1, 3]", "in_burn_in": 0}
    con.execute(f"INSERT INTO records ({', '.join(kept)}) VALUES "
                f"({', '.join('?' * len(kept))})", [row[k] for k in kept])
    con.commit()
    con.close()
    with RecordStore(db) as store:
        store.append(rec(4))
        assert store.records("e") == [old, rec(4)]
