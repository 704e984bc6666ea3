"""The SQLite file that every experiment's records go to as they finish.

One connection shared behind a lock, so that the server's threads may append at once. Each
append is its own committed transaction in WAL mode: once `append` returns, the row survives a
SIGKILL of the process (synchronous=NORMAL gives up durability only on power loss, not on a
process crash, and keeps an append to one write without an fsync).
"""

from __future__ import annotations

import csv
import json
import sqlite3
import threading
import time
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TextIO

from experiments.record import RequestRecord

FIELDS = [f.name for f in fields(RequestRecord)]
_TYPES = {f.name: str(f.type) for f in fields(RequestRecord)}
# Lists (and any dict a later field may hold) are JSON text; booleans are 0/1.
_JSON = {k for k, t in _TYPES.items() if t.startswith(("list", "dict"))}
_BOOL = {k for k, t in _TYPES.items() if t.split(" |")[0] == "bool"}
_DEFAULTED = {f.name for f in fields(RequestRecord)
              if f.default is not MISSING or f.default_factory is not MISSING}


def _sql_type(annotation: str) -> str:
    base = annotation.split(" |")[0]
    return {"int": "INTEGER", "bool": "INTEGER", "float": "REAL"}.get(base, "TEXT")


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    {", ".join(f"{k} {_sql_type(t)}" for k, t in _TYPES.items())}
);
CREATE INDEX IF NOT EXISTS records_by_experiment ON records (experiment, finished_at);
CREATE TABLE IF NOT EXISTS experiments (
    name TEXT PRIMARY KEY,
    definition TEXT NOT NULL,
    saved_at REAL NOT NULL
);
"""


def _row(record: RequestRecord) -> list[Any]:
    d = record.to_dict()
    for k in _JSON:
        d[k] = json.dumps(d[k])
    for k in _BOOL:
        d[k] = int(bool(d[k]))
    return [d[k] for k in FIELDS]


def _record(row: sqlite3.Row) -> RequestRecord:
    d = {k: row[k] for k in FIELDS}
    for k in _JSON:
        d[k] = json.loads(d[k]) if d[k] is not None else None
    for k in _BOOL:
        d[k] = bool(d[k])
    # NULL in a column added after the row was written: the field's default.
    return RequestRecord.from_dict({k: v for k, v in d.items()
                                    if v is not None or k not in _DEFAULTED})


class RecordStore:
    """Experiment records and definitions in one SQLite file (created where missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: autocommit, so that no statement is left in an open transaction.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=30.0)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            # A file from before a field was added to RequestRecord gets its column.
            have = {r[1] for r in self._db.execute("PRAGMA table_info(records)")}
            for k in FIELDS:
                if k not in have:
                    self._db.execute(f"ALTER TABLE records ADD COLUMN {k} {_sql_type(_TYPES[k])}")

    def append(self, record: RequestRecord) -> None:
        """Store one finished request; committed before this returns."""
        row = _row(record)
        sql = (f"INSERT INTO records ({', '.join(FIELDS)}) "
               f"VALUES ({', '.join('?' * len(FIELDS))})")
        with self._lock:
            self._db.execute(sql, row)

    def records(self, experiment: str) -> list[RequestRecord]:
        """The experiment's records in the order they finished."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM records WHERE experiment = ? ORDER BY finished_at, id",
                (experiment,)).fetchall()
        return [_record(r) for r in rows]

    def experiments(self) -> list[str]:
        """Every experiment name that has records or a saved definition, sorted."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT experiment FROM records UNION "
                                    "SELECT name FROM experiments ORDER BY 1").fetchall()
        return [r[0] for r in rows]

    def save_experiment(self, name: str, definition: dict[str, Any]) -> None:
        """Keep (or replace) an experiment's definition: arms, control, weights, design."""
        text = json.dumps(definition, sort_keys=True)
        with self._lock:
            self._db.execute("INSERT INTO experiments (name, definition, saved_at) "
                             "VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                             "definition = excluded.definition, saved_at = excluded.saved_at",
                             (name, text, time.time()))

    def experiment(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT definition FROM experiments WHERE name = ?",
                                   (name,)).fetchone()
        return json.loads(row[0]) if row else None

    def export_csv(self, experiment: str | None, out: TextIO) -> int:
        """Write the records (of one experiment, or all) as CSV with a header row; lists as
        JSON text, booleans as 0/1, None as an empty cell. Returns the number of rows."""
        sql, args = "SELECT * FROM records", ()
        if experiment is not None:
            sql, args = sql + " WHERE experiment = ?", (experiment,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY experiment, finished_at, id",
                                    args).fetchall()
        w = csv.writer(out)
        w.writerow(FIELDS)
        for r in rows:
            w.writerow(["" if r[k] is None else r[k] for k in FIELDS])
        return len(rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
