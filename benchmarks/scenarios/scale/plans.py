"""The plan of the worker's claim: EXPLAIN (ANALYZE, BUFFERS) of the
statements it sends, captured as it runs (harness.internals)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from benchmarks.harness.db import MESSAGE_TABLE
from benchmarks.harness.internals import Statement, queue_connection
from benchmarks.scenarios.scale import PARTIAL_INDEXES

MAIN_VERB = re.compile(r"^\s*(?:WITH\b.*?\)\s*)?(SELECT|UPDATE|DELETE|INSERT)\b", re.I | re.S)


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _plan_nodes(child)


def explain(statements: list[Statement]) -> list[dict[str, Any]]:
    """EXPLAIN (ANALYZE, BUFFERS) of the claim's statements, in order, in a
    transaction that is rolled back. Returns one summary per statement."""
    from django.db import transaction

    conn = queue_connection()
    outputs = {}
    for fmt in ("JSON", "TEXT"):
        rows = []
        with transaction.atomic(using=conn.alias):
            with conn.cursor() as cursor:
                for sql, params in statements:
                    cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT {fmt}) {sql}", params)
                    rows.append(cursor.fetchall())
            transaction.set_rollback(True, using=conn.alias)
        outputs[fmt] = rows
    summaries = []
    for (sql, _), json_rows, text_rows in zip(
        statements, outputs["JSON"], outputs["TEXT"], strict=True
    ):
        doc = json_rows[0][0]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        top = doc[0]
        nodes = list(_plan_nodes(top["Plan"]))
        words = sql.split()
        verb = MAIN_VERB.match(sql)
        kind = (verb.group(1).upper() if verb else words[0].upper()) + (
            " ... FOR UPDATE" if "FOR UPDATE" in sql.upper() else ""
        )
        summaries.append(
            {
                "statement": kind,
                "sql": " ".join(words),
                "indexes": sorted({n["Index Name"] for n in nodes if "Index Name" in n}),
                "seq_scans": sorted(
                    {n.get("Relation Name", "?") for n in nodes if n["Node Type"] == "Seq Scan"}
                ),
                "shared_hit": top["Plan"].get("Shared Hit Blocks", 0),
                "shared_read": top["Plan"].get("Shared Read Blocks", 0),
                "rows": top["Plan"].get("Actual Rows"),
                "execution_ms": top.get("Execution Time"),
                "planning_ms": top.get("Planning Time"),
                "text": "\n".join(row[0] for row in text_rows),
            }
        )
    return summaries


def buffers(summaries: list[dict[str, Any]]) -> int:
    """Shared buffers hit and read, all of the claim's statements."""
    return sum(s["shared_hit"] + s["shared_read"] for s in summaries)


def execution_ms(summaries: list[dict[str, Any]]) -> float:
    return sum(s["execution_ms"] or 0 for s in summaries)


def indexes(summaries: list[dict[str, Any]]) -> list[str]:
    return sorted({i for s in summaries for i in s["indexes"]})


def plan_verdict(summaries: list[dict[str, Any]]) -> bool:
    """Uses a partial index of the claim, and no sequential scan of the message table."""
    seq = {t for s in summaries for t in s["seq_scans"]}
    return bool(set(indexes(summaries)) & set(PARTIAL_INDEXES)) and MESSAGE_TABLE not in seq
