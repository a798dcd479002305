// graphile-worker (Node) as a peer of `orch-bench peers`: the peer protocol of ../README.md.
// The database is DATABASE_URL. Runs on Node 22 (graphile-worker 0.18 needs >= 22.18).
//
//   node peer.mjs migrate            create graphile-worker's schema
//   node peer.mjs enqueue N          add N no-op jobs with addJobs, 5,000 per call; prints
//                                    {"enqueue_s": S} (the calls only)
//   node peer.mjs worker C MODE      prints `ready`, waits for `go` on stdin, then runs a worker
//                                    with concurrency C until stdin closes; MODE `batched` = a
//                                    local queue of 100 and completions batched without delay,
//                                    `per-job` = the library's defaults
//   node peer.mjs watch              refreshes the planner's statistics of the jobs table,
//                                    prints `ready`; after `go`, looks every 20 ms for a job
//                                    left in the table (finished jobs are deleted) and prints
//                                    `empty` at the first look that finds none. The Rust port
//                                    keeps the same tables, so this watches it too.
//   node peer.mjs latency N          an idle worker (concurrency 1) in this process; N times:
//                                    add one job, wait for its handler to start, sleep
//                                    20–100 ms; prints {"pickup_ms": [..], "enqueue_ms": [..]}
import { performance } from "node:perf_hooks";
import readline from "node:readline";
import { Logger, makeWorkerUtils, run, runMigrations } from "graphile-worker";
import pg from "pg";

const connectionString = process.env.DATABASE_URL;
if (!connectionString) fail("DATABASE_URL is not set");

// Warnings and errors only, on stderr: stdout carries the protocol.
const logger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") process.stderr.write(`graphile-worker ${level}: ${message}\n`);
});

function fail(message) {
  process.stderr.write(`gw-peer: ${message}\n`);
  process.exit(1);
}

function workerOptions(concurrency, mode, taskList) {
  const worker = {};
  if (mode === "batched") {
    worker.localQueue = { size: 100 };
    worker.completeJobBatchDelay = 0;
    worker.failJobBatchDelay = 0;
  }
  return { connectionString, concurrency, noHandleSignals: true, taskList, logger, crontab: "", preset: { worker } };
}

// Resolves at the first stdin line equal to `go`; `onClose` runs when stdin ends.
function waitForGo(onClose) {
  const lines = readline.createInterface({ input: process.stdin });
  lines.on("close", onClose);
  return new Promise((resolve) => lines.on("line", (l) => l.trim() === "go" && resolve()));
}

async function enqueue(n) {
  const utils = await makeWorkerUtils({ connectionString, logger });
  const jobs = Array.from({ length: n }, (_, i) => ({ identifier: "noop", payload: { n: i } }));
  const t0 = performance.now();
  for (let i = 0; i < n; i += 5000) await utils.addJobs(jobs.slice(i, i + 5000));
  const seconds = (performance.now() - t0) / 1000;
  await utils.release();
  console.log(JSON.stringify({ enqueue_s: seconds }));
}

async function worker(concurrency, mode) {
  let handled = 0;
  console.log("ready");
  await waitForGo(() => {
    process.stderr.write(`gw-peer: ${handled} jobs handled\n`);
    process.exit(0);
  });
  // Start-up (pool, migration check) counts: it happens after `go`.
  const runner = await run(workerOptions(concurrency, mode, { noop: async () => { handled++; } }));
  await runner.promise;
}

async function watch() {
  const client = new pg.Client({ connectionString });
  await client.connect();
  await client.query("vacuum analyze graphile_worker._private_jobs");
  console.log("ready");
  await waitForGo(() => process.exit(0));
  for (;;) {
    const { rows } = await client.query("select exists (select 1 from graphile_worker._private_jobs) as left");
    if (!rows[0].left) break;
    await new Promise((r) => setTimeout(r, 20));
  }
  console.log("empty");
  await client.end();
}

async function latency(n) {
  let started = null;
  const runner = await run(
    workerOptions(1, "per-job", {
      noop: async () => {
        if (started) started(performance.now());
      },
    }),
  );
  const utils = await makeWorkerUtils({ connectionString, logger });
  // Let the worker reach its idle, listening state.
  await new Promise((r) => setTimeout(r, 500));
  let seed = 0x2545f491;
  const gapMs = () => {
    seed ^= seed << 13; seed ^= seed >>> 17; seed ^= seed << 5; seed >>>= 0;
    return 20 + (seed % 81);
  };
  const pickup = [], enqueue = [];
  for (let i = 0; i < n; i++) {
    const handlerStart = new Promise((r) => (started = r));
    const t0 = performance.now();
    await utils.addJob("noop", { n: i });
    const t1 = performance.now();
    let timer;
    const t2 = await Promise.race([handlerStart, new Promise((r) => (timer = setTimeout(() => r(null), 30000)))]);
    clearTimeout(timer);
    if (t2 === null) fail(`job ${i} was not picked up within 30 s`);
    pickup.push(t2 - t0);
    enqueue.push(t1 - t0);
    await new Promise((r) => setTimeout(r, gapMs()));
  }
  await utils.release();
  await runner.stop();
  console.log(JSON.stringify({ pickup_ms: pickup, enqueue_ms: enqueue }));
}

const [command, a, b] = process.argv.slice(2);
const commands = {
  migrate: () => runMigrations({ connectionString, logger }),
  enqueue: () => enqueue(Number(a)),
  worker: () => worker(Number(a), b || "per-job"),
  watch,
  latency: () => latency(Number(a)),
};
if (!commands[command]) fail("usage: peer.mjs migrate | enqueue N | worker C [per-job|batched] | watch | latency N");
commands[command]().then(
  () => process.exit(0),
  (e) => fail(e && e.stack ? e.stack : String(e)),
);
