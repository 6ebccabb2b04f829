"""The tables' sizes and what autovacuum did to them, at one moment."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import db
from benchmarks.scenarios.soak import TABLES


def snapshot() -> dict[str, Any]:
    """For each table of TABLES: its heap, every index and the total (bytes),
    live and dead rows, and the vacuum and analyze counters (statistics as
    the server last flushed them: up to a second old)."""
    db.execute("SELECT pg_stat_clear_snapshot()")
    out = {}
    for table in TABLES:
        (heap, indexes, total, live, dead, vacuums, autovacuums, autoanalyzes, last_av) = db.rows(
            "SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid),"
            " pg_total_relation_size(c.oid), s.n_live_tup, s.n_dead_tup, s.vacuum_count,"
            " s.autovacuum_count, s.autoanalyze_count, s.last_autovacuum::text"
            " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid"
            " WHERE c.oid = %s::regclass",
            [table],
        )[0]
        out[table] = {
            "heap_bytes": heap,
            "indexes_bytes": indexes,
            "total_bytes": total,
            "index_bytes": dict(
                db.rows(
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)"
                    " FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1",
                    [table],
                )
            ),
            "live_rows": live,
            "dead_rows": dead,
            "vacuum_count": vacuums,
            "autovacuum_count": autovacuums,
            "autoanalyze_count": autoanalyzes,
            "last_autovacuum": last_av,
        }
    return out


def storage_options(table: str) -> list[str]:
    """The table's storage parameters (pg_class.reloptions)."""
    options = db.scalar("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [table])
    return list(options or [])
