"""The engine factory: the ServingEngine a config asks for (the local engine, or routing over Triton).

It sits above both serving loops so neither imports the other; the HTTP server, the CLI and the
benchmarks ask here rather than choosing a class themselves.
"""
from __future__ import annotations

from collections.abc import Callable

from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_api import ServingEngine

_builder: Callable[[MFSConfig], ServingEngine] | None = None


def serve_engines_from(builder: Callable[[MFSConfig], ServingEngine] | None) -> None:
    """From now on in this process, build_serving_engine(config) is builder(config) (None: the default again): a
    launcher serves an engine assembled elsewhere (eval's compared systems) through the same server and CLI."""
    global _builder
    _builder = builder


def build_serving_engine(config: MFSConfig) -> ServingEngine:
    """For engine.kind 'local': ProcessServing (engine.process 'separate', the default) or LocalServing ('thread');
    for 'triton': TritonServing (MFS routing over Triton) in a child process behind ProcessServing ('separate')
    or in the HTTP process ('thread').
    Imports are deferred so a local deployment never needs the Triton client's packages, and back."""
    if _builder is not None:
        return _builder(config)
    separate = config.engine.process == "separate"     # the orchestrator core in its own process
    if config.engine.kind == "triton":
        if separate:
            from orchestrator.serve.engine_process import ProcessServing
            from orchestrator.serve.triton_process import triton_main

            return ProcessServing(config, child_main=triton_main)
        from orchestrator.serve.triton_serving import TritonServing

        return TritonServing(config)
    if separate:
        from orchestrator.serve.engine_process import ProcessServing

        return ProcessServing(config)
    from orchestrator.serve.serving import LocalServing

    return LocalServing(config)
