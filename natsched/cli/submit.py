"""``natsched submit``: one request, its completion (or its tokens as they come) and one summary line."""

from __future__ import annotations

import sys
from dataclasses import asdict

from natsched.cli.options import CLIENT_CONNECT_BUDGET_S, fail, run, url_flag

REJECTED = 2  # exit code of a refused request: a script may retry it later


def add_parsers(sub) -> None:
    sm = sub.add_parser("submit", help="submit one request and print its result",
                        description="Submit one request and print the completion (or stream it).")
    url_flag(sm)
    sm.add_argument("--tenant", required=True)
    sm.add_argument("--class", dest="cls", default="online", help="online | batch | offline (default online)")
    sm.add_argument("--prompt", required=True)
    sm.add_argument("--system-prompt", default=None)
    sm.add_argument("--model", default="default")
    sm.add_argument("--max-tokens", type=int, default=64)
    sm.add_argument("--id", default=None, help="request id (default: random); resubmitting an id is refused")
    sm.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    sm.add_argument("--json", action="store_true", help="print the result as JSON")
    sm.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for admission (default 30)")
    sm.set_defaults(handler=cmd_submit)


def cmd_submit(args) -> int:
    return run(_submit(args))


async def _submit(args) -> int:
    import orjson

    from natsched.client.errors import Rejected
    from natsched.client.producer import Client, Timeouts, make_request

    client = await Client.connect(args.nats_url, Timeouts(admission=args.timeout),
                                  connect_budget_s=CLIENT_CONNECT_BUDGET_S, credentials=args.credentials)
    try:
        extra = {"id": args.id} if args.id else {}
        request = make_request(args.tenant, args.prompt, cls=args.cls, model=args.model, max_tokens=args.max_tokens,
                               system_prompt=args.system_prompt, **extra)
        if args.stream:
            stream = client.stream(request)
            async for chunk in stream:
                if not args.json:
                    print(chunk.text, end="", flush=True)
            result = stream.result
            if not args.json:
                print()
        else:
            result = await client.submit(request)
            if not args.json:
                print(result.text.strip() if result.status == "completed" else f"degraded: job {result.job_id}")
        if args.json:
            print(orjson.dumps(asdict(result)).decode())
        elif result is not None:
            print(f"[{result.request_id} on {result.worker}: {result.prompt_tokens} prompt tokens "
                  f"({result.cached_tokens} cached), {result.output_tokens} output, e2e {result.e2e:.3f}s]",
                  file=sys.stderr)
        return 0
    except Rejected as exc:
        retry = f" (retry after {exc.retry_after:.1f}s)" if exc.retry_after else ""
        return fail(f"{exc}{retry}", REJECTED)
    finally:
        await client.close()
