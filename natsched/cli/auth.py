"""``natsched auth init``: NATS accounts, per-role permissions and credentials (:mod:`natsched.ops.auth`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from natsched.cli.argtypes import positive_int
from natsched.cli.options import fail


def add_parsers(sub) -> None:
    au = sub.add_parser("auth", help="lock roles and tenants to their subjects (NATS accounts and permissions)",
                        description="Generate a NATS server config with one user per role and per-role "
                                    "permissions, and a credentials file per role.")
    au_sub = au.add_subparsers(dest="action", required=True, metavar="ACTION")
    init_p = au_sub.add_parser("init", help="write nats-auth.conf and creds/<user>.json",
                               description="Write DIR/nats-auth.conf (nats-server -c) and DIR/creds/<user>.json "
                                           "for admin, admitter, router, the offline runner, each worker, the "
                                           "gateway, and each tenant's producer and batch producer (and with "
                                           "--partitions / --router-pools each partition's admitter, the "
                                           "coordinator and each pool's router).")
    init_p.add_argument("--out", default="natsched-auth", help="output directory (default ./natsched-auth)")
    init_p.add_argument("--tenants", default="demo", help="comma-separated tenants, one producer user each "
                                                          "(default demo)")
    init_p.add_argument("--workers", default="w1,w2", help="comma-separated worker ids, one worker user each "
                                                           "(default w1,w2, as natsched up names them)")
    init_p.add_argument("--gateway-tenants", default=None, metavar="TENANTS",
                        help="comma-separated tenants the gateway user may publish for: the tenants its API keys "
                             "name (default: every --tenants; '' for no gateway user)")
    init_p.add_argument("--batch-tenants", default=None, metavar="TENANTS",
                        help="comma-separated tenants with a batch-<tenant> user for natsched batch/jobs "
                             "(default: every --tenants; '' for none)")
    init_p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="the offline runner's user (default: yes; natsched up runs the runner)")
    init_p.add_argument("--partitions", type=positive_int, default=1, metavar="N",
                        help="partitioned admission (natsched up --partitions P, any P <= N): a user per "
                             "partition, admitter-p0..admitter-p<N-1>, each confined to its partition's "
                             "consumers and bucket, and the budget coordinator's (default 1: none)")
    init_p.add_argument("--router-pools", default="", metavar="SPEC",
                        help="router pools, the spec natsched up --router-pools takes ('a=m1;b=m2,*'): a user "
                             "router-<pool> per pool, confined to its pool's consumer (default: none)")
    init_p.add_argument("--tls", action="store_true", help="also make a self-signed CA and a server certificate "
                                                           "for 127.0.0.1/localhost (openssl)")
    init_p.add_argument("--force", action="store_true", help="replace an existing config (every password changes)")
    init_p.set_defaults(handler=cmd_auth)


def parse_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _optional_list(text: str | None) -> list[str] | None:
    """A list flag whose absence means "the default" and whose empty value means "none"."""
    return None if text is None else parse_list(text)


def auth_settings(args):
    from natsched.ops.auth import AuthSettings

    return AuthSettings(out=Path(args.out), tenants=parse_list(args.tenants), workers=parse_list(args.workers),
                        gateway_tenants=_optional_list(args.gateway_tenants),
                        batch_tenants=_optional_list(args.batch_tenants), offline=args.offline,
                        partitions=args.partitions, router_pools=args.router_pools, tls=args.tls, force=args.force)


def cmd_auth(args) -> int:
    """``natsched auth init``: prints where everything went and how to use it."""
    from natsched.ops.auth import AuthError, init

    settings = auth_settings(args)
    try:
        files = init(settings)
    except AuthError as exc:
        return fail(str(exc))
    print(f"server config: {files.config}")
    print(f"  start a server with it: nats-server -js -c {files.config}  (or: natsched cluster up --auth-config ...)")
    for user, path in files.credentials.items():
        print(f"credentials {user:<24} {path}")
    if files.tls_ca:
        print(f"TLS CA: {files.tls_ca} (named in every credentials file)")
    print("provision streams and buckets with the admin credentials first; services and producers then "
          "connect with --credentials FILE")
    print(f"  or run everything on these credentials: natsched up --auth-dir {settings.out}")
    return 0
