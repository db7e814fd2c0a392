// ioredis, the peer of our Redis client's per-command cost (issue 35, benchmarks/redis_cpu.py):
// C concurrent async loops share ONE `new IORedis(url)` (its defaults: one connection, no
// auto-pipelining) and send N commands in all, each loop awaiting its reply before its next
// command. Per round: process CPU (user + system, process.cpuUsage) and wall time per command.
//   node run_ioredis.mjs --redis URL --commands N --callers C --rounds R [--command RPUSH]
// Prints ONE JSON line: {"peer", "version", "callers", "rounds": [{"cpu_us", "wall_us"}, ...]}.
// ioredis is loaded from the folder in $IOREDIS_DIR (default: .envs/ioredis beside this file).

import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const IOREDIS_DIR = process.env.IOREDIS_DIR || path.join(HERE, ".envs", "ioredis");
const require = createRequire(path.join(IOREDIS_DIR, "package.json"));
const IORedis = require("ioredis");
const VERSION = require("ioredis/package.json").version;

function parseArgs(argv) {
  const args = { redis: null, commands: 20000, callers: 10, rounds: 3, command: "RPUSH" };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "");
    if (!(key in args)) throw new Error(`unknown argument ${argv[i]}`);
    const value = argv[i + 1];
    args[key] = typeof args[key] === "number" ? Number(value) : value;
  }
  if (!args.redis) throw new Error("usage: --redis URL [--commands N --callers C --rounds R]");
  const u = new URL(args.redis);
  if (Number(u.port || 6379) === 6379) {
    throw new Error("port 6379 is the machine's shared Redis: never used here");
  }
  return args;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const u = new URL(args.redis);
  const redis = new IORedis({
    host: u.hostname || "127.0.0.1",
    port: Number(u.port),
    db: Number((u.pathname || "/0").slice(1) || 0),
  });
  const key = `bench:ioredis:${args.callers}`;
  const call = () =>
    args.command === "PING" ? redis.ping() : redis.rpush(key, "x");
  await redis.ping(); // connected outside the timing
  const per = Math.floor(args.commands / args.callers);
  const total = per * args.callers;
  // an untimed warm-up of 20,000 commands, whatever N: the JIT compiles the hot path first
  const loop = async (count) => {
    for (let i = 0; i < count; i++) await call();
  };
  const warm = Math.ceil(20000 / args.callers);
  await Promise.all(Array.from({ length: args.callers }, () => loop(warm)));
  const rounds = [];
  for (let r = 0; r < args.rounds; r++) {
    const cpu0 = process.cpuUsage();
    const wall0 = process.hrtime.bigint();
    await Promise.all(Array.from({ length: args.callers }, () => loop(per)));
    const wall = Number(process.hrtime.bigint() - wall0) / 1e3; // microseconds
    const cpu = process.cpuUsage(cpu0);
    rounds.push({ cpu_us: (cpu.user + cpu.system) / total, wall_us: wall / total });
    await redis.del(key);
  }
  redis.disconnect();
  process.stdout.write(
    JSON.stringify({ peer: "ioredis", version: VERSION, callers: args.callers, rounds }) + "\n",
  );
}

main().catch((error) => {
  process.stdout.write(JSON.stringify({ peer: "ioredis", error: String(error) }) + "\n");
  process.exit(1);
});
