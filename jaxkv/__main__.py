"""The command line: `python -m jaxkv {audit,...}`."""

from __future__ import annotations

import argparse
import sys

from ._config import list_model_configs, load_model_config
from ._zeroing import pool_zeroing_plan


def _audit(args: argparse.Namespace) -> int:
  names = args.models or list_model_configs()
  for name in names:
    config = load_model_config(name)
    pool = config.pool
    print(f"{config.name}: {config.num_layers} layers, {pool.num_blocks} blocks of"
          f" {pool.page_size_bytes:,} bytes x {pool.num_tensors} tensors"
          f" = {pool.total_bytes / 2**30:.2f} GiB")
    plan = pool_zeroing_plan(pool)
    for group in pool.groups:
      decision = plan[group.name]
      verdict = "zeroes new blocks" if decision.required else "no zeroing"
      print(f"  group {group.name!r} ({len(group.layer_names)} layers, {type(group.spec).__name__},"
            f" page {group.spec.page_size_bytes:,} B + {pool.padding_bytes[group.name]:,} B padding,"
            f" backend {group.backend}): {verdict}")
      for reason in decision.reasons:
        print(f"    - {reason}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jaxkv",
      description="jaxkv: a NaN-safe paged KV cache for LLM inference in JAX.",
  )
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  audit = sub.add_parser("audit", help="print each model config's pool and which groups zero new blocks, with why")
  audit.add_argument("models", nargs="*", help=f"shipped config names (default: all of {list_model_configs()})")
  audit.set_defaults(run=_audit)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if not hasattr(args, "run"):
    parser.print_help()
    return 0
  try:
    return args.run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
