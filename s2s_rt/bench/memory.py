"""Memory mode: the server's RSS idle and with every slot in a session, per pool size."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from s2s_rt.bench.report import base_report
from s2s_rt.bench.run import Run
from s2s_rt.bench.server import ServerHandle, server_env
from s2s_rt.bench.session import SessionClient
from s2s_rt.speech_cache import Clip


async def run_memory(opts: argparse.Namespace, clips: list[Clip]) -> dict[str, Any]:
    """Start the server per pool size, fill every slot, report RSS idle and active."""
    results = []
    run: Run | None = None
    for pool in opts.pool_sizes:
        server = await asyncio.to_thread(
            ServerHandle.spawn, opts.stack, pool, env=server_env(opts), extra=opts.server_arg
        )
        try:
            await asyncio.sleep(1.0)
            idle = server.proc()
            run = Run(opts, clips)
            metronome = asyncio.create_task(run.metronome.run())
            # One answered turn first, so every engine has run once (arenas and caches allocated).
            warm = SessionClient(run, 0, respond=True)
            if await warm.open(server.url):
                await warm.speak(0, 0)
            await warm.close()
            warmed = server.proc()
            clients = [SessionClient(run, i + 1, respond=False) for i in range(pool)]
            opened = await asyncio.gather(*(c.open(server.url) for c in clients))
            # Every slot hears one question (VAD, buffers, STT) while all are connected; a few at a
            # time, so the engines' queues stay short (this measures memory, not capacity).
            gate = asyncio.Semaphore(opts.memory_turns_at_once)

            async def one_turn(i: int, client: SessionClient, gate: asyncio.Semaphore = gate) -> None:
                async with gate:
                    await client.speak(1, i % len(clips))

            await asyncio.gather(*(one_turn(i, c) for i, c in enumerate(clients) if opened[i]), return_exceptions=True)
            await asyncio.sleep(opts.hold_s)
            active = server.proc()
            for c in clients:
                await c.close()
            metronome.cancel()
            await asyncio.gather(metronome, return_exceptions=True)
            await asyncio.sleep(1.0)
            after = server.proc()
            results.append(
                {
                    "pool_size": pool,
                    "sessions_active": sum(opened),
                    "rss_mb_idle": idle.rss_mb if idle else None,
                    "rss_mb_warm": warmed.rss_mb if warmed else None,
                    "rss_mb_all_slots_active": active.rss_mb if active else None,
                    "rss_mb_after_sessions_closed": after.rss_mb if after else None,
                    "rss_mb_peak": after.hwm_mb if after else None,
                    "failures": list(run.failures),
                }
            )
            if not opts.quiet:
                r = results[-1]
                print(
                    f"pool {pool}: RSS idle {r['rss_mb_idle']:.1f} MB, warm {r['rss_mb_warm']:.1f} MB,"
                    f" {r['sessions_active']} active {r['rss_mb_all_slots_active']:.1f} MB,"
                    f" peak {r['rss_mb_peak']:.1f} MB",
                    file=sys.stderr,
                )
        finally:
            await asyncio.to_thread(server.stop)
    per_slot: dict[str, Any] = {}
    if len(results) >= 2:
        a, b = results[0], results[-1]
        extra = b["pool_size"] - a["pool_size"]
        for key in ("rss_mb_idle", "rss_mb_all_slots_active", "rss_mb_peak"):
            if a[key] is not None and b[key] is not None and extra:
                per_slot[key] = (b[key] - a[key]) / extra
    assert run is not None
    report = base_report(opts, run, ServerHandle("(spawned per pool size)"), 0.0)
    report["settings"] |= {"pool_sizes": opts.pool_sizes, "hold_s": opts.hold_s, "stack": opts.stack}
    report["memory"] = results
    report["per_extra_slot_mb"] = per_slot
    report["ok"] = all(not r["failures"] for r in results)
    return report
