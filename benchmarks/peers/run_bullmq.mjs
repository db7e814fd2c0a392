// BullMQ: `new Queue(name)` + `queue.add` / `queue.addBulk`; `new Worker(name, processor,
// { concurrency: 10 })` in a separate worker process (this script again, `--role worker`).
// Same arguments, protocol and output as the Python runners (see _common.py):
//   node run_bullmq.mjs --redis URL --scenario S1|S2|S3|S4 --jobs N --queues K --window S ...
// bullmq itself is loaded from the folder in $BULLMQ_DIR (default: .envs/bullmq beside this file).
// S1 with `--body file|rpush` (the drains of issue 35, benchmarks/drains.py): each job's body
// appends one byte to a file (fs.writeSync on a descriptor opened once) or sends one RPUSH
// through ONE ioredis client opened at the worker's start (`await redis.rpush(key, "x")`); the
// worker counts the distinct jobs done in memory and, at the last, stamps its time (and its
// CPU since its start) in a file: no done-signal I/O beside the body.

import { spawn } from "node:child_process";
import dgram from "node:dgram";
import fs from "node:fs";
import { createRequire } from "node:module";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const BULLMQ_DIR = process.env.BULLMQ_DIR || path.join(HERE, ".envs", "bullmq");
const require = createRequire(path.join(BULLMQ_DIR, "package.json"));
const { Queue, Worker } = require("bullmq");
const IORedis = require("ioredis");

const monotonic = () => Number(process.hrtime.bigint()) / 1e9; // CLOCK_MONOTONIC, in seconds
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function parseArgs(argv) {
  const args = {
    redis: null, scenario: null, jobs: 10000, queues: 1, window: 10, samples: 300,
    warmup: 30, deadline: 60, settle: 2, concurrency: 10, role: "producer", body: "none",
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "");
    if (!(key in args)) throw new Error(`unknown argument ${argv[i]}`);
    const value = argv[i + 1];
    args[key] = typeof args[key] === "number" ? Number(value) : value;
  }
  if (!args.redis || !["S1", "S2", "S3", "S4"].includes(args.scenario)) {
    throw new Error("usage: --redis URL --scenario S1|S2|S3|S4 [--jobs N --queues K --window S]");
  }
  if (!["none", "file", "rpush"].includes(args.body)) throw new Error(`unknown --body ${args.body}`);
  args.queueNames = Array.from({ length: Math.max(1, args.queues) }, (_, i) => `bench${i}`);
  return args;
}

function connectionOptions(url) {
  const u = new URL(url);
  const port = Number(u.port || 6379);
  if (port === 6379) throw new Error("port 6379 is the machine's shared Redis: never used here");
  const db = Number((u.pathname || "/0").slice(1) || 0);
  return { host: u.hostname || "127.0.0.1", port, db, maxRetriesPerRequest: null };
}

// ------------------------------------------------------------------------- job side

const jobState = { fd: null, sock: null, cpuAtStart: null };

function jobDone(n) {
  const now = monotonic();
  if (process.env.BENCH_DONE_FILE) {
    if (jobState.fd === null) jobState.fd = fs.openSync(process.env.BENCH_DONE_FILE, "a");
    const buf = Buffer.alloc(16);
    buf.writeBigInt64LE(BigInt(n), 0);
    buf.writeDoubleLE(now, 8);
    fs.writeSync(jobState.fd, buf);
  }
  if (process.env.BENCH_PROBE_PORT) {
    if (jobState.sock === null) jobState.sock = dgram.createSocket("udp4");
    const buf = Buffer.alloc(16);
    buf.writeBigInt64LE(BigInt(n), 0);
    buf.writeDoubleLE(now, 8);
    jobState.sock.send(buf, Number(process.env.BENCH_PROBE_PORT), "127.0.0.1");
  }
}

// The drains' bodies (--body file|rpush): the body, then the in-memory count of jobs done.
async function drainBody(args, connection) {
  const body = process.env.BENCH_BODY;
  const target = process.env.BENCH_BODY_TARGET;
  const jobs = Number(process.env.BENCH_JOBS);
  const seen = new Set();
  const counted = (n) => {
    seen.add(n);
    if (seen.size === jobs) {
      const now = monotonic();
      const cpu = process.cpuUsage(jobState.cpuAtStart);
      const file = process.env.BENCH_DONE_STAMP;
      fs.writeFileSync(`${file}.tmp`, `${now} ${(cpu.user + cpu.system) / 1e6}`);
      fs.renameSync(`${file}.tmp`, file);
    }
  };
  if (body === "file") {
    const fd = fs.openSync(target, "a");
    const one = Buffer.from("x");
    return async (job) => { fs.writeSync(fd, one); counted(job.data.n); };
  }
  const redis = new IORedis(connection);
  await redis.ping(); // connected before the worker's start stamp, as its broker client is
  return async (job) => { await redis.rpush(target, "x"); counted(job.data.n); };
}

async function workerMain(args) {
  const connection = connectionOptions(args.redis);
  const processor = process.env.BENCH_BODY
    ? await drainBody(args, connection)
    : async (job) => jobDone(job.data.n);
  const workers = args.queueNames.map(
    (name) =>
      new Worker(name, processor, {
        connection,
        concurrency: args.concurrency,
        autorun: false,
      }),
  );
  const stop = async () => {
    await Promise.allSettled(workers.map((w) => w.close()));
    process.exit(0);
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  const parent = process.ppid; // a worker whose producer died (killed on a time-out) exits
  setInterval(() => { if (process.ppid !== parent) process.exit(1); }, 500).unref();
  jobState.cpuAtStart = process.cpuUsage();
  stamp("BENCH_STARTED_FILE");
  const running = workers.map((w) => w.run());
  await Promise.all(workers.map((w) => w.waitUntilReady()));
  stamp("BENCH_READY_FILE");
  await Promise.all(running);
}

function stamp(variable) {
  const file = process.env[variable];
  if (file) {
    fs.writeFileSync(`${file}.tmp`, String(monotonic()));
    fs.renameSync(`${file}.tmp`, file);
  }
}

// ------------------------------------------------------------------------- producer side

class BenchError extends Error {}

const liveWorkers = new Set();

class WorkerProcess {
  constructor(workdir, args, env) {
    this.log = path.join(workdir, "worker.log");
    this.startedFile = path.join(workdir, "started");
    this.readyFile = path.join(workdir, "ready");
    const out = fs.openSync(this.log, "w");
    const argv = [
      fileURLToPath(import.meta.url), "--redis", args.redis, "--scenario", args.scenario,
      "--queues", String(args.queues), "--concurrency", String(args.concurrency),
      "--role", "worker", "--body", args.body,
    ];
    this.exited = null;
    this.child = spawn(process.execPath, argv, {
      stdio: ["ignore", out, out],
      env: {
        ...process.env, ...env, BENCH_STARTED_FILE: this.startedFile, BENCH_READY_FILE: this.readyFile,
      },
      detached: true,
    });
    this.child.on("exit", (code, signal) => { this.exited = code ?? signal; });
    liveWorkers.add(this);
    fs.closeSync(out);
  }

  logTail() {
    try {
      return fs.readFileSync(this.log, "utf8").trim().split("\n").slice(-3).join(" | ");
    } catch {
      return "(no log)";
    }
  }

  checkAlive() {
    if (this.exited !== null) throw new BenchError(`worker exited with ${this.exited}: ${this.logTail()}`);
  }

  async waitStarted(timeout = 60, ready = false) {
    const deadline = monotonic() + timeout;
    while (monotonic() < deadline) {
      this.checkAlive();
      try {
        const text = fs.readFileSync(ready ? this.readyFile : this.startedFile, "utf8");
        if (text) return Number(text);
      } catch {}
      await sleep(5);
    }
    throw new BenchError(`worker did not start within ${timeout} s: ${this.logTail()}`);
  }

  async stop() {
    const kill = (sig) => { try { process.kill(-this.child.pid, sig); } catch {} };
    if (this.exited === null) {
      kill("SIGTERM");
      const deadline = monotonic() + 5;
      while (this.exited === null && monotonic() < deadline) await sleep(20);
    }
    kill("SIGKILL");
    liveWorkers.delete(this);
  }
}

class Probe {
  constructor() {
    this.sock = dgram.createSocket("udp4");
    this.seen = new Map();
    this.waiter = null;
    this.sock.on("message", (buf) => {
      const n = Number(buf.readBigInt64LE(0));
      const when = buf.readDoubleLE(8);
      this.seen.set(n, when);
      if (this.waiter && this.waiter.n === n) this.waiter.resolve(when);
    });
  }

  async open() {
    await new Promise((resolve) => this.sock.bind(0, "127.0.0.1", resolve));
    this.port = this.sock.address().port;
  }

  wait(n, timeout) {
    if (this.seen.has(n)) return Promise.resolve(this.seen.get(n));
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new BenchError(`job ${n} did not complete in ${timeout} s`)), timeout * 1000);
      this.waiter = { n, resolve: (when) => { clearTimeout(timer); this.waiter = null; resolve(when); } };
    });
  }

  close() { this.sock.close(); }
}

const result = (metric, value, unit, note = "") => ({ metric, value, unit, note });

function percentile(values, q) {
  const ordered = [...values].sort((a, b) => a - b);
  const rank = Math.max(1, Math.min(ordered.length, Math.round((q / 100) * ordered.length + 0.5)));
  return ordered[rank - 1];
}

async function prefill(queue, n) {
  for (let start = 0; start < n; start += 1000) {
    const batch = [];
    for (let i = start; i < Math.min(n, start + 1000); i++) batch.push({ name: "noop", data: { n: i } });
    await queue.addBulk(batch);
  }
  return "queue.addBulk, 1,000 jobs a call";
}

function completions(data) {
  const first = new Map(); // job number -> first completion time
  for (let off = 0; off + 16 <= data.length; off += 16) {
    const n = Number(data.readBigInt64LE(off));
    const when = data.readDoubleLE(off + 8);
    if (!first.has(n) || when < first.get(n)) first.set(n, when);
  }
  return first;
}

async function s1(ctx) {
  const { args, workdir } = ctx;
  const queue = new Queue(args.queueNames[0], { connection: connectionOptions(args.redis) });
  const begun = monotonic();
  const how = await prefill(queue, args.jobs);
  const prefillS = monotonic() - begun;
  await queue.close();
  const doneFile = path.join(workdir, "done");
  fs.writeFileSync(doneFile, "");
  const worker = new WorkerProcess(workdir, args, { BENCH_DONE_FILE: doneFile });
  let data;
  let t0;
  let spawned;
  try {
    spawned = monotonic();
    t0 = await worker.waitStarted();
    let target = 16 * args.jobs;
    const stopAt = t0 + args.deadline;
    while (monotonic() <= stopAt) {
      if (fs.statSync(doneFile).size >= target) {
        const missing = args.jobs - completions(fs.readFileSync(doneFile)).size;
        if (missing <= 0) break;
        target += 16 * missing; // some ran twice: wait for the rest
      }
      worker.checkAlive();
      await sleep(5);
    }
    data = fs.readFileSync(doneFile);
  } finally {
    await worker.stop();
  }
  const done = completions(data);
  const count = done.size;
  if (count === 0) throw new BenchError(`no job completed within ${args.deadline} s: ${worker.logTail()}`);
  const times = [...done.values()];
  const first = Math.min(...times);
  const last = Math.max(...times);
  let note = `${count} jobs in ${(last - t0).toFixed(2)} s from worker start`;
  if (count > 1 && last > first) note += ` (${((count - 1) / (last - first)).toFixed(0)} jobs/s from the 1st job done)`;
  const runs = Math.floor(data.length / 16);
  if (runs > count) note += `; ${runs - count} job(s) ran twice`;
  note += `; worker start-up ${(t0 - spawned).toFixed(2)} s not counted; spawn -> 1st job done ${(first - spawned).toFixed(3)} s; prefilled in ${prefillS.toFixed(1)} s (${how})`;
  if (count < args.jobs) note += `; stopped after ${args.deadline} s with ${count}/${args.jobs} jobs done`;
  return [result("drain", count / (last - t0), "jobs/s", note)];
}

async function redisCpu(redis) {
  const text = await redis.info("cpu");
  const field = (name) => Number(new RegExp(`${name}:([0-9.]+)`).exec(text)[1]);
  return field("used_cpu_user") + field("used_cpu_sys");
}

// S1 with a body (--body file|rpush): from the worker's start to its stamp of the last job done.
async function s1Body(ctx) {
  const { args, workdir } = ctx;
  const queue = new Queue(args.queueNames[0], { connection: connectionOptions(args.redis) });
  const how = await prefill(queue, args.jobs);
  await queue.close();
  const stampFile = path.join(workdir, "all-done");
  const target = args.body === "file" ? path.join(workdir, "body") : "bench:drains:bullmq";
  const probe = new IORedis(connectionOptions(args.redis));
  const serverCpu0 = await redisCpu(probe);
  const worker = new WorkerProcess(workdir, args, {
    BENCH_BODY: args.body, BENCH_BODY_TARGET: target, BENCH_JOBS: String(args.jobs),
    BENCH_DONE_STAMP: stampFile,
  });
  let t0;
  let spawned;
  let stamp = null;
  try {
    spawned = monotonic();
    t0 = await worker.waitStarted();
    const stopAt = t0 + args.deadline;
    while (stamp === null && monotonic() <= stopAt) {
      try {
        stamp = fs.readFileSync(stampFile, "utf8").split(" ").map(Number);
      } catch {
        worker.checkAlive();
        await sleep(5);
      }
    }
  } finally {
    await worker.stop();
  }
  const serverCpu = (await redisCpu(probe)) - serverCpu0; // includes the worker's stop: small
  probe.disconnect();
  if (stamp === null) throw new BenchError(`the drain did not end within ${args.deadline} s: ${worker.logTail()}`);
  let bodies;
  if (args.body === "file") {
    bodies = fs.statSync(target).size;
  } else {
    const redis = new IORedis(connectionOptions(args.redis));
    bodies = await redis.llen(target);
    await redis.del(target);
    redis.disconnect();
  }
  const [last, cpu] = stamp;
  const note = `${args.jobs} jobs, ${bodies} bodies run, in ${(last - t0).toFixed(2)} s from worker start`
    + `; worker start-up ${(t0 - spawned).toFixed(2)} s not counted; ${how}`;
  return [
    result("drain", args.jobs / (last - t0), "jobs/s", note),
    result("cpu", (cpu / args.jobs) * 1e6, "us/job", "worker CPU from its start stamp to the last job done"),
    result("redis-cpu", (serverCpu / args.jobs) * 1e6, "us/job", "redis-server CPU from the worker's spawn to its stop"),
  ];
}

async function s2(ctx) {
  const { args } = ctx;
  const n = args.jobs;
  const queue = new Queue(args.queueNames[0], { connection: connectionOptions(args.redis) });
  await queue.add("noop", { n: -1 }); // connection + scripts, untimed
  let start = process.hrtime.bigint();
  for (let i = 0; i < n; i++) await queue.add("noop", { n: i });
  const one = Number(process.hrtime.bigint() - start) / 1e9;
  const jobs = [];
  for (let i = 0; i < n; i++) jobs.push({ name: "noop", data: { n: i } });
  start = process.hrtime.bigint();
  await queue.addBulk(jobs);
  const bulk = Number(process.hrtime.bigint() - start) / 1e9;
  await queue.close();
  return [
    result("one-by-one", n / one, "jobs/s", "await queue.add('noop', {n: i})"),
    result("bulk", n / bulk, "jobs/s", `one queue.addBulk of ${n} jobs`),
  ];
}

async function s3(ctx) {
  const { args } = ctx;
  const probe = new Probe();
  await probe.open();
  const worker = new WorkerProcess(ctx.workdir, args, { BENCH_PROBE_PORT: String(probe.port) });
  const queue = new Queue(args.queueNames[0], { connection: connectionOptions(args.redis) });
  const samples = [];
  try {
    await worker.waitStarted(60, true);
    const warmUntil = monotonic() + 2;
    for (let i = 0; i < args.warmup && monotonic() <= warmUntil; i++) {
      await queue.add("noop", { n: i });
      await probe.wait(i, 30);
    }
    const stopAt = monotonic() + args.deadline;
    for (let i = 1_000_000; i < 1_000_000 + args.samples; i++) {
      const start = monotonic();
      await queue.add("noop", { n: i });
      samples.push(((await probe.wait(i, 30)) - start) * 1000);
      if (monotonic() > stopAt && samples.length >= 10) break;
    }
  } finally {
    await queue.close();
    await worker.stop();
    probe.close();
  }
  let note = `${samples.length} samples after a warm-up`;
  if (samples.length < args.samples) note += ` (cut at the ${args.deadline} s deadline)`;
  const mean = samples.reduce((a, b) => a + b, 0) / samples.length;
  return [
    result("p50", percentile(samples, 50), "ms", note),
    result("p99", percentile(samples, 99), "ms", note),
    result("mean", mean, "ms", note),
  ];
}

async function commandstats(redis) {
  const text = await redis.info("commandstats");
  const calls = {};
  for (const line of text.split(/\r?\n/)) {
    const m = /^cmdstat_([^:]+):calls=(\d+)/.exec(line);
    if (m) calls[m[1]] = Number(m[2]);
  }
  return calls;
}

async function s4(ctx) {
  const { args } = ctx;
  const redis = new IORedis(connectionOptions(args.redis));
  const worker = new WorkerProcess(ctx.workdir, args, {});
  let before;
  let after;
  let elapsed;
  try {
    await worker.waitStarted(60, true);
    await sleep(args.settle * 1000);
    worker.checkAlive();
    before = await commandstats(redis);
    const start = monotonic();
    await sleep(args.window * 1000);
    after = await commandstats(redis);
    elapsed = monotonic() - start;
    worker.checkAlive();
  } finally {
    await worker.stop();
    redis.disconnect();
  }
  // our own connection: INFO (excluded), and ioredis' connect-time commands (before the window)
  const delta = Object.entries(after)
    .filter(([k]) => k !== "info")
    .map(([k, v]) => [k, v - (before[k] || 0)])
    .filter(([, v]) => v > 0)
    .sort((a, b) => b[1] - a[1]);
  const total = delta.reduce((a, [, v]) => a + v, 0);
  const detail = delta.slice(0, 4).map(([k, v]) => `${k} ${(v / elapsed).toFixed(1)}/s`).join(", ") || "no command";
  const note = `${args.queues} queue(s), ${elapsed.toFixed(1)} s window ${args.settle} s after ready: ${detail}`;
  return [result(`${args.queues}q`, total / elapsed, "cmds/s", note)];
}

async function producerMain(args) {
  const out = { peer: "bullmq", scenario: args.scenario, queues: args.queues };
  const workdir = fs.mkdtempSync(path.join(os.tmpdir(), "bench-bullmq-"));
  let code = 0;
  try {
    out.version = require("bullmq/package.json").version;
    const ctx = { args, workdir };
    const run = { S1: args.body === "none" ? s1 : s1Body, S2: s2, S3: s3, S4: s4 }[args.scenario];
    out.results = await run(ctx);
    out.notes = [];
  } catch (err) {
    console.error(err);
    out.error = `${err.name}: ${err.message}`;
    code = 1;
  } finally {
    fs.rmSync(workdir, { recursive: true, force: true });
  }
  process.stdout.write(`${JSON.stringify(out)}\n`);
  return code;
}

const args = parseArgs(process.argv.slice(2));
if (args.role !== "worker") {
  process.on("SIGTERM", async () => {
    for (const worker of liveWorkers) await worker.stop();
    process.exit(1);
  });
}
if (args.role === "worker") {
  await workerMain(args);
} else {
  process.exit(await producerMain(args));
}
