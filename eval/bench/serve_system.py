"""Serves one of eval's compared systems (`baseline`, `baseline_elastic`, ...) over HTTP with `mfs serve`'s own
server, so that a harness that reaches MFS over HTTP (`mfs bench --peer`) reaches the compared system the same way:

    python -m eval.bench.serve_system --system baseline --config SYSTEM.yaml --port P [mfs serve's flags]

SYSTEM.yaml is the compared system's whole configuration (eval/composition.py SystemConfig: MFS's keys and its
`comparison` section, as eval/systems.py system_config composes it). The engine core is assembled as `mfs bench`
assembles it in-process (system_family, core_parts with the system's scheduler and tiers); everything else is
`mfs serve`: the same server, flags, limits and drain, and the same engine process (engine.process: separate,
the default) with the same executor. The server reads MFS's part of the configuration (without `comparison`) and
asks orchestrator/serve/factory.py for its engine, which this process answers with the compared system's.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from eval.composition import SystemConfig, core_parts, system_family
from eval.systems import SYSTEMS, system_scheduler, system_tiers
from orchestrator.core.config import ConfigError, MFSConfig, load_config
from orchestrator.core.engine_api import ServingEngine
from orchestrator.core.family import FamilyError


def system_config_file(config: SystemConfig, path: Path) -> Path:
    """`config` as a YAML file this launcher (and load_config(cls=SystemConfig)) reads back as the same config."""
    path.write_text(yaml.safe_dump(json.loads(json.dumps(asdict(config)))))
    return path


def mfs_part(config: SystemConfig) -> dict[str, Any]:
    """What `mfs serve`'s own loader reads: the configuration without its `comparison` section."""
    data = json.loads(json.dumps(asdict(config)))
    data.pop("comparison")
    return data


def compared_engine(system: str, config: SystemConfig) -> ServingEngine:
    """The ServingEngine of compared system `system`: its core in an engine process of its own (engine.process:
    separate, as `mfs serve` runs MFS's), or in this process's thread (thread)."""
    if config.engine.kind != "local":
        raise ConfigError("a compared system runs on the local engine (engine.kind: local)")
    family = system_family(config)
    if config.engine.process == "thread":
        from orchestrator.serve.serving import LocalServing

        return LocalServing(config, family, **core_parts(config, system_scheduler(system), system_tiers(system)))
    from orchestrator.serve.engine_process import ProcessServing, engine_main

    return ProcessServing(config, family,
                          child_main=functools.partial(engine_main, parts=functools.partial(compared_parts, system)))


def compared_parts(system: str, config: SystemConfig) -> dict[str, Any]:
    """EngineCore's keywords for compared system `system` (made in its engine process): its family,
    scheduler and tiers, as `mfs bench` builds them in-process."""
    return {"family": system_family(config), **core_parts(config, system_scheduler(system), system_tiers(system))}


def build_parser() -> argparse.ArgumentParser:
    from orchestrator.serve import server

    parser = argparse.ArgumentParser(prog="python -m eval.bench.serve_system",
                                     description="serve one of eval's compared systems with mfs serve's server")
    parser.add_argument("--system", required=True, choices=[s for s in SYSTEMS if s != "mfs"],
                        help="the compared system (eval/systems.py); its configuration is --config")
    server.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from orchestrator.serve import factory, server

    args = build_parser().parse_args(argv)
    if args.config is None:
        print("serve_system: --config (the compared system's configuration) is required", file=sys.stderr)
        return 2
    if args.engine not in (None, "local"):
        print("serve_system: a compared system runs on the local engine", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, {"family": args.family} if args.family else None, cls=SystemConfig)
        assert isinstance(config, SystemConfig)
    except (ConfigError, FamilyError) as exc:
        print(f"serve_system: {exc}", file=sys.stderr)
        return 2
    plain = mfs_part(config)

    def build(given: MFSConfig) -> ServingEngine:
        # the server's settings come from the same configuration as the engine (a mismatch is a launcher bug)
        if json.loads(json.dumps(asdict(given))) != plain:
            raise ConfigError("serve_system: the server read another configuration than the compared system's")
        return compared_engine(args.system, config)

    with tempfile.TemporaryDirectory(prefix="mfs-serve-system-") as tmp:
        path = Path(tmp) / "mfs.yaml"
        path.write_text(yaml.safe_dump(plain))
        factory.serve_engines_from(build)
        try:
            return server.main(argparse.Namespace(**{**vars(args), "config": str(path), "family": None}))
        finally:
            factory.serve_engines_from(None)


if __name__ == "__main__":
    sys.exit(main())
