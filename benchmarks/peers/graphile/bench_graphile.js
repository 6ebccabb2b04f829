#!/usr/bin/env node
/*
graphile-worker's side of benchmarks/compare.py, the Node.js counterpart of
the peers' Python client scripts: one operation per call, answering one JSON
object on the last line of stdout.

    node bench_graphile.js info|setup|enqueue-single|enqueue-bulk|latency-enqueue [--n N]
        [--spacing S] [--prefix P] [--chunk 1000] [--rate R --start-at T | --start-file F --senders K --sender J [--batch-late]]
    node bench_graphile.js worker [--once] [--concurrency N] [--local-queue N]
        [--complete-batch-delay MS] [--poll-interval MS]

The database is BENCH_DSN. Tasks: `noop` (does nothing) and `latency`
(appends "<key> <epoch seconds>" to BENCH_LATENCY_FILE, its first act).
Enqueue: `workerUtils.addJob("noop", payload)` per message (one statement,
graphile_worker.add_job, autocommit: a transaction each); bulk:
`workerUtils.addJobs([...])` (graphile_worker.add_jobs, one statement) per
chunk of --chunk (1,000) jobs. The worker is the library's `run()`
(`runOnce()` with --once: exit when no job is left), with graphile-worker's
own defaults unless an option says otherwise: concurrentJobs 1, no local
queue, no batched completes, poll every 2 s with LISTEN. Its logger drops
info and debug lines (graphile-worker logs every completed job at info; the
other systems run at WARNING too).
*/
"use strict";

const fs = require("fs");
const { parseArgs } = require("util");
const {
  Logger,
  consoleLogFactory,
  makeWorkerUtils,
  run,
  runMigrations,
  runOnce,
} = require("graphile-worker");

const DSN = process.env.BENCH_DSN;

function emit(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

const QUIET = new Set(["debug", "info"]);
const logger = new Logger((scope) => {
  const log = consoleLogFactory(scope);
  return (level, message, meta) => {
    if (!QUIET.has(level)) log(level, message, meta);
  };
});

function recordStart(key) {
  // One appendFileSync (O_APPEND, one write of a short line): the lines of
  // concurrent handlers never mix. Same machine, same clock as the enqueuer.
  const now = Date.now() / 1000;
  const path = process.env.BENCH_LATENCY_FILE;
  if (path) fs.appendFileSync(path, `${key} ${now.toFixed(6)}\n`);
}

const taskList = {
  noop: async () => {},
  latency: async (payload) => {
    recordStart(payload.key);
  },
};

const OPTIONS = {
  n: { type: "string", default: "0" },
  variant: { type: "string", default: "" },
  spacing: { type: "string", default: "0.02" },
  prefix: { type: "string", default: "" },
  chunk: { type: "string", default: "1000" },
  rate: { type: "string", default: "0" },
  "start-at": { type: "string", default: "0" },
  "start-file": { type: "string", default: "" },
  "stop-at": { type: "string", default: "0" },
  senders: { type: "string", default: "1" },
  sender: { type: "string", default: "0" },
  "batch-late": { type: "boolean", default: false },
  once: { type: "boolean", default: false },
  concurrency: { type: "string" },
  "local-queue": { type: "string" },
  "complete-batch-delay": { type: "string" },
  "poll-interval": { type: "string" },
};

function seconds(startedNs) {
  return Number(process.hrtime.bigint() - startedNs) / 1e9;
}

async function withUtils(fn) {
  const utils = await makeWorkerUtils({ connectionString: DSN, logger });
  try {
    return await fn(utils);
  } finally {
    await utils.release();
  }
}

async function worker(values) {
  const options = { connectionString: DSN, taskList, logger };
  if (values.concurrency) options.concurrency = Number(values.concurrency);
  if (values["poll-interval"]) options.pollInterval = Number(values["poll-interval"]);
  const preset = { worker: {} };
  if (values["local-queue"]) preset.worker.localQueue = { size: Number(values["local-queue"]) };
  if (values["complete-batch-delay"] !== undefined) {
    const delay = Number(values["complete-batch-delay"]);
    preset.worker.completeJobBatchDelay = delay;
    preset.worker.failJobBatchDelay = delay;
  }
  if (values.concurrency) {
    // The pool's recommended size: max(10, concurrentJobs + 2) (WorkerOptions.maxPoolSize).
    preset.worker.maxPoolSize = Math.max(10, Number(values.concurrency) + 2);
  }
  options.preset = preset;
  if (values.once) {
    await runOnce(options);
    return;
  }
  const runner = await run(options);
  await runner.promise; // until SIGTERM/SIGINT: graphile-worker shuts down gracefully
}

async function client(op, values) {
  const n = Number(values.n);
  if (op === "info") {
    const version = (name) => require(`${name}/package.json`).version;
    return {
      versions: { "graphile-worker": version("graphile-worker"), pg: version("pg") },
      runtime: `Node.js ${process.version}`,
    };
  }
  if (op === "setup") {
    await runMigrations({ connectionString: DSN, logger });
    return { ok: true };
  }
  return withUtils(async (utils) => {
    if (op === "enqueue-single") {
      await utils.addJob("noop", { n: -1 }); // warm up, not timed
      await utils.withPgClient((c) => c.query("DELETE FROM graphile_worker._private_jobs"));
      const started = process.hrtime.bigint();
      for (let i = 0; i < n; i++) await utils.addJob("noop", { n: i });
      return { seconds: seconds(started), n };
    }
    if (op === "enqueue-bulk") {
      const chunk = Number(values.chunk);
      const specs = [];
      for (let i = 0; i < n; i++) specs.push({ identifier: "noop", payload: { n: i } });
      const started = process.hrtime.bigint();
      for (let i = 0; i < n; i += chunk) await utils.addJobs(specs.slice(i, i + chunk));
      return { seconds: seconds(started), n, chunk };
    }
    if (op === "latency-enqueue") {
      // As the Python peers' _common.latency_loop: --spacing apart, or open
      // loop (--rate): message i due at --start-at + i / rate, this sender's
      // share every --senders-th from --sender, sent when due (at once when late).
      const spacing = Number(values.spacing) * 1000;
      const rate = Number(values.rate);
      const senders = Number(values.senders);
      const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
      const sent = [];
      await utils.withPgClient((c) => c.query("SELECT 1")); // connect first
      let startAt = Number(values["start-at"]);
      let stopAt = Number(values["stop-at"]);
      if (rate && values["start-file"]) {
        // Say ready, wait for the file that holds the start (all senders start together).
        process.stdout.write("ready\n");
        while (!fs.existsSync(values["start-file"])) await sleep(1);
        [startAt, stopAt] = fs.readFileSync(values["start-file"], "utf8").split(" ").map(Number);
      }
      const readyAt = Date.now() / 1000;
      const pending = [];
      for (let i = rate ? Number(values.sender) : 0; i < n; i += rate ? senders : 1) {
        pending.push([`${values.prefix}${i}`, rate ? startAt + i / rate : null]);
      }
      let transactions = 0;
      for (let i = 0; i < pending.length; ) {
        const due = pending[i][1];
        if (due !== null && stopAt && Date.now() / 1000 > stopAt) break; // far behind: stop
        if (due !== null && due * 1000 > Date.now()) await sleep(due * 1000 - Date.now());
        // --batch-late: a late sender sends every job due by now in one statement (addJobs).
        let j = i + 1;
        const now = Date.now() / 1000;
        if (values["batch-late"] && due !== null) while (j < pending.length && pending[j][1] <= now) j++;
        const keys = pending.slice(i, j);
        if (keys.length > 1) {
          await utils.addJobs(keys.map(([key]) => ({ identifier: "latency", payload: { key } })));
        } else {
          await utils.addJob("latency", { key: keys[0][0] });
        }
        const committed = Date.now() / 1000;
        transactions++;
        for (const [key, d] of keys) sent.push(d === null ? [key, committed] : [key, committed, d]);
        i = j;
        if (due === null) await sleep(spacing);
      }
      return { sent, ready_at: readyAt, transactions };
    }
    throw new Error(`unknown op ${JSON.stringify(op)}`);
  });
}

async function main() {
  const { values, positionals } = parseArgs({ options: OPTIONS, allowPositionals: true });
  const op = positionals[0];
  if (!DSN) throw new Error("BENCH_DSN is not set");
  if (op === "worker") {
    await worker(values);
  } else {
    emit(await client(op, values));
  }
}

main().catch((error) => {
  console.error(error && error.stack ? error.stack : error);
  process.exit(1);
});
