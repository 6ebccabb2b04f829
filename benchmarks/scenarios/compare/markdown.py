"""The compare scenario's Markdown report: one row per system and variant, the
commands used, the targets."""

from benchmarks.scenarios.compare import REPEAT_MAX_DRAIN_S
from benchmarks.scenarios.compare.targets import jobs


def fmt_rate(value, run=None):
    if value is None:
        return "-"
    text = f"{value:,.0f}"
    if run and run.get("timed_out"):
        text += " (timeout)"
    elif run and run.get("problems"):
        text += " (!)"
    return text


def fmt_ratio(value, base):
    if value is None or not base:
        return "-"
    ratio = value / base
    return f"{ratio:.2f}" if ratio < 10 else f"{ratio:.1f}"


def fmt_cpu(run):
    value = (run or {}).get("worker_cpu_us_per_job")
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def fmt_server(run, key):
    value = (run or {}).get(key)
    if value is None:
        return "-"
    text = f"{value:.1f}" if value < 100 else f"{value:,.0f}"
    if key == "server_cpu_us_per_job" and run.get("backends_cpu_us_per_job") is not None:
        text += f" ({fmt_server(run, 'backends_cpu_us_per_job')})"
    return text


def targets_table(out, title, targets):
    out.append(title)
    out.append("")
    out.append("| target | measured | required | result |")
    out.append("|---|---|---|---|")
    for t in targets:
        verdict = "n/a" if t["met"] is None else ("PASS" if t["met"] else "FAIL")
        note = f" ({t['note']})" if t["note"] else ""
        out.append(f"| {t['target']} | {t['value']} | {t['required']} | {verdict}{note} |")


def load_table(out, results, opts):
    """Latency at load: one row per system and offered rate."""
    rows = [(r, load) for r in results if r.get("status") == "ok" for load in r.get("load") or []]
    if not rows:
        return
    out.append("")
    out.append(
        f"Latency at load: enqueues offered open loop for {opts['load_seconds']:g} s by"
        f" {opts['load_senders']} sender processes on one schedule (each message sent when due,"
        " one transaction each, whatever the worker does"
        + (
            "; a late sender sends the messages due in one transaction"
            if opts.get("load_batch")
            else ""
        )
        + "), one listening worker; commit to"
        " handler start, and due to handler start (the senders' lag added). A percentage is"
        " of the system's own fastest one-process drain."
    )
    out.append("")
    out.append(
        "| system | offered | offered /s | sent /s | p50 / p95 / p99 ms | from due p99 ms"
        " | senders' lag p99 ms | lost / dup |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r, load in rows:
        if "p50_ms" not in load:
            problem = load.get("problem", "nothing handled")
            out.append(f"| {r['label']} | {load['rate']} | {problem} | | | | | |")
            continue
        sent = f"{load['sent_per_s']:,.0f}" + ("" if load["reached"] else " (not reached)")
        sent += " (late start)" if load["late_start"] else ""
        sent_n = load["messages"] - load.get("unsent", 0)
        if load.get("unsent"):
            sent += f" ({load['unsent']:,} of {load['messages']:,} unsent)"
        if load.get("transactions") and load["transactions"] < sent_n:
            sent += f" ({sent_n / load['transactions']:.1f}/txn)"
        out.append(
            f"| {r['label']} | {load['rate']} | {load['offered_per_s']:,.0f} | {sent} |"
            f" {load['p50_ms']:.1f} / {load['p95_ms']:.1f} / {load['p99_ms']:.1f} |"
            f" {load['from_due']['p99_ms']:.1f} | {load['send_lag_p99_ms']:.1f} |"
            f" {load['missing']} / {load['duplicated']} |"
        )


def markdown(report):
    results = report["systems"]
    by = {r["name"]: r for r in results if r.get("status") == "ok"}
    raw = by.get("raw", {})
    raw100 = jobs(raw, "batch100", 1)[0] if raw else None
    raw100_2 = jobs(raw, "batch100", 2)[0] if raw else None
    raw_single = raw.get("enqueue_single_per_s")
    raw_bulk = raw.get("enqueue_bulk_per_s")
    opts = report["options"]
    env = report["environment"]
    out = []
    out.append(
        f"{opts['messages']:,} no-op messages per drain, {opts['enqueue_messages']:,} for the "
        f"one-per-transaction enqueue; {env['cpus']} CPUs, PostgreSQL {env['postgres']} "
        f"(synchronous_commit={env['synchronous_commit']}), Python {env['python']}, "
        f"commit {env['commit']}, {report['started_at']}; load average (1 min) at start"
        f" {env['load_average_at_start'][0]:.1f}, at end {env['load_average_at_end'][0]:.1f}."
    )
    out.append("")
    header = [
        "system / variant",
        "drain 1 proc /s",
        "x raw b100",
        "drain 2 procs /s",
        "x raw b100 (2)",
        "worker CPU us/job, 1 / 2 procs",
        "server CPU us/job (its backends), 1 / 2 procs",
        "WAL B/job, 1 / 2 procs",
        "enqueue 1/txn /s",
        "x raw",
        "bulk enqueue /s",
        "x raw",
        "latency p50 / p95 / p99 ms",
        "idle queries/s",
        "peak RSS MiB",
    ]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for r in results:
        if r.get("status") != "ok":
            out.append(
                f"| {r['label']} | not run: {r.get('reason', '?').splitlines()[0][:120]} |"
                + " |" * (len(header) - 2)
            )
            continue
        lat = r.get("latency") or {}
        lat_text = (
            f"{lat['p50_ms']:.1f} / {lat['p95_ms']:.1f} / {lat['p99_ms']:.1f}"
            if "p50_ms" in lat
            else "-"
        )
        if lat.get("missing") or lat.get("duplicated"):
            lat_text += f" ({lat['missing']} lost, {lat['duplicated']} dup)"
        idle = r.get("idle")
        idle_text = f"{idle['queries_per_s']:.2f}" if idle else "-"
        for key, variant in r["variants"].items():
            j1, run1 = jobs(r, key, 1)
            j2, run2 = jobs(r, key, 2)
            rss = [x for run in variant["runs"].values() for x in run["peak_rss_mib"]]
            out.append(
                "| "
                + " | ".join(
                    [
                        variant["label"],
                        fmt_rate(j1, run1),
                        fmt_ratio(j1, raw100),
                        fmt_rate(j2, run2),
                        fmt_ratio(j2, raw100_2),
                        " / ".join(fmt_cpu(run) for run in (run1, run2)),
                        " / ".join(
                            fmt_server(run, "server_cpu_us_per_job") for run in (run1, run2)
                        ),
                        " / ".join(fmt_server(run, "wal_bytes_per_job") for run in (run1, run2)),
                        fmt_rate(r.get("enqueue_single_per_s")),
                        fmt_ratio(r.get("enqueue_single_per_s"), raw_single),
                        fmt_rate(r.get("enqueue_bulk_per_s")),
                        fmt_ratio(r.get("enqueue_bulk_per_s"), raw_bulk),
                        lat_text,
                        idle_text,
                        f"{max(rss):.0f}" if rss else "-",
                    ]
                )
                + " |"
            )
    out.append("")
    out.append(
        "Drain: messages / (first job claimed to queue empty, watched in the database),"
        " burst workers, backlog VACUUM ANALYZEd first, median of up to"
        f" {opts['repeat']} runs (a drain longer than {REPEAT_MAX_DRAIN_S:g} s runs once);"
        " (timeout): the run hit --run-timeout, the rate is over the part drained;"
        " (!): see the JSON's problems. Worker CPU: user + system time of the worker"
        " processes (from wait4) per job, less each"
        " process's start-up and exit (a burst worker of the same command on an empty queue,"
        " median of 3), median of the runs; the database server's CPU is not in it."
        " Server CPU: utime + stime (+ cutime + cstime) of every process of the PostgreSQL"
        " server (/proc/<pid>/stat: the postmaster and its children) from before the workers"
        " start to after their connections closed, per job, the drain monitor's backend left"
        " out: the whole server, so its background processes and anything else it served"
        " meanwhile count too, and the workers' connecting and start-up queries. WAL:"
        " pg_current_wal_insert_lsn() difference over the same window, per job (the whole"
        " server too). Both medians of the runs. (its backends): the CPU of the server"
        " backends of the system's own database only (the workers' connections), sampled"
        " until they exit: a lower bound, whatever else the server does."
        " Enqueue one per transaction: median of"
        f" {opts['repeat']} runs. Enqueue and latency are per system (the same on"
        " each of its rows); x raw b100 (2) compares with the raw loop with 2 processes."
        " Latency: an idle listening worker, messages enqueued one at a time"
        f" {opts['latency_spacing_ms']:g} ms apart, commit to handler start. Idle: queries"
        f" per second over {opts['idle_seconds']:g} s, the larger of the database's"
        " transactions (pg_stat_database) and the statements seen in pg_stat_activity,"
        " each system's default polling. Peak RSS: VmHWM of one worker process."
    )
    out.append("")
    out.append("| system | worker | enqueue 1/txn | bulk enqueue | idle worker waits on |")
    out.append("|---|---|---|---|---|")
    for r in results:
        if r.get("status") != "ok":
            continue
        notes = r["notes"]
        versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items())
        out.append(
            f"| {r['label']} ({versions}; {r.get('runtime') or 'Python ' + str(r.get('python'))})"
            f" | {notes['worker']} | "
            f"{notes['enqueue_single']} | {notes['enqueue_bulk']} | {notes['idle']} |"
        )
    load_table(out, results, opts)
    out.append("")
    targets_table(out, "Targets (django-pgqueue):", report["targets"])
    if report.get("issue41_targets"):
        out.append("")
        targets_table(out, "Issue 41's targets (this run):", report["issue41_targets"])
    errors = [(r["label"], e) for r in results for e in r.get("errors", [])]
    problems = [
        (r["label"], v["label"], p, run["processes"])
        for r in results
        if r.get("status") == "ok"
        for v in r["variants"].values()
        for run in v["runs"].values()
        for p in run["problems"]
    ]
    if errors or problems:
        out.append("")
        out.append("Problems:")
        out.append("")
        for label, e in errors:
            out.append(f"- {label}: {e.splitlines()[0]}")
        for _label, variant, p, processes in problems:
            out.append(f"- {variant}, {processes} process(es): {p.splitlines()[0]}")
    return "\n".join(out) + "\n"
