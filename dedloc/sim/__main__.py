"""`python -m dedloc.sim SCENARIO --peers N [--aux M] [--seed S] [--epochs E] [--max-group-size G]
[--average-state-every K] [--joiners J] [--period SECONDS] [--json] [--trace FILE]`: run one scenario of the
swarm simulator and print what it measured (scenarios.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable

import orjson
import structlog

from .loop import START, run_virtual
from .scenarios import EPOCH_SECONDS, SCENARIOS, run_scenario
from .trace import tracing


def _virtual_time(logger: object, method: str, event: dict[str, object]) -> dict[str, object]:
    """Each line says when it happened in simulated seconds (`t`, from the run's start), not
    on the wall clock (the loop's time races ahead of it), and which peer logged it (`sim`)."""
    with contextlib.suppress(RuntimeError):  # (no loop, before or after the run: no time)
        event["t"] = round(asyncio.get_running_loop().time() - START, 3)
    return event


def _only(events: str) -> Callable[[object, str, dict[str, object]], dict[str, object]]:
    wanted = {e.strip() for e in events.split(",") if e.strip()}

    def only(logger: object, method: str, event: dict[str, object]) -> dict[str, object]:
        if wanted and event.get("event") not in wanted:
            raise structlog.DropEvent
        return event

    return only


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration orders too: one seed, one run
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "dedloc.sim", *(argv or sys.argv[1:])])
    parser = argparse.ArgumentParser(prog="python -m dedloc.sim", description=__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--peers", type=int, default=16, help="trainers (default 16)")
    parser.add_argument("--aux", type=int, default=None, help="aux peers (default peers/16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=10, help="epochs to run (default 10)")
    parser.add_argument("--max-group-size", type=int, default=None,
                        help="averaging.max_group_size (default: one group for all, up to 195)")
    parser.add_argument("--average-state-every", type=int, default=None,
                        help="the manifest's average_state_every (default 0: never)")
    parser.add_argument("--joiners", type=int, default=None,
                        help="flash-crowd, churn: peers joining at once (default 100)")
    parser.add_argument("--period", type=float, default=None,
                        help="churn: simulated seconds between two replacements of 20%% of the "
                             "trainers (default 600; the flash crowd comes at half of the first)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--log-level", default="error", help="the daemons' log level")
    parser.add_argument("--log-events", default="",
                        help="log only these events (comma-separated names), e.g. at debug level")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write every callback the loop runs to FILE (slow): two traces of "
                             "one command show where runs part (trace.py)")
    args = parser.parse_args(argv)
    if args.peers < 1:
        parser.error("--peers must be at least 1")
    # (`not >=`: NaN is refused too)
    if args.period is not None and (args.scenario != "churn"
                                    or not args.period >= 4 * EPOCH_SECONDS):
        parser.error("--period is for churn only, at least 80 simulated seconds (4 epochs)")
    level = getattr(logging, args.log_level.upper(), logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level),
                        processors=[_only(args.log_events), structlog.contextvars.merge_contextvars,
                                    _virtual_time,
                                    structlog.processors.add_log_level,
                                    structlog.dev.ConsoleRenderer(colors=False)])
    run = {} if args.max_group_size is None else {"max_group_size": args.max_group_size}
    if args.average_state_every is not None:
        run["average_state_every"] = args.average_state_every
    script = {} if args.joiners is None or args.scenario not in ("flash-crowd", "churn") \
        else {"joiners": args.joiners}
    if args.period is not None:
        script["period"] = args.period
    with contextlib.ExitStack() as stack:
        if args.trace is not None:
            stack.enter_context(tracing(stack.enter_context(open(args.trace, "w", encoding="utf-8"))))
        result = run_virtual(run_scenario(args.scenario, args.peers, aux=args.aux,
                                          seed=args.seed, epochs=args.epochs, script=script,
                                          **run))
    data = result.to_json()
    if args.json:
        sys.stdout.write(orjson.dumps(data).decode() + "\n")
    else:
        for key, value in data.items():
            sys.stdout.write(f"{key:32} {value}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
