"""`mfs dashboard [--server URL[,URL...]] [--results FILE] [--port P]`: run the Streamlit app in a child process."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from orchestrator.serve.optional import require

APP_PATH = Path(__file__).with_name("app.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="MFS server base URL for live mode (default: $MFS_SERVER_URL); "
                                         "several fleet replicas comma-separated give a node selector")
    parser.add_argument("--results", help="`mfs bench` results JSON for results mode")
    parser.add_argument("--port", type=int, default=8501, help="dashboard port (default 8501)")
    parser.add_argument("--address", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    parser.add_argument("--open-browser", action="store_true", help="open a browser tab (default: headless)")


def streamlit_command(args: argparse.Namespace) -> list[str]:
    app_args = []
    if args.server:
        app_args += ["--server", args.server]
    if args.results:
        app_args += ["--results", args.results]
    return [sys.executable, "-m", "streamlit", "run", str(APP_PATH),
            "--server.port", str(args.port), "--server.address", args.address,
            "--server.headless", "false" if args.open_browser else "true",
            "--browser.gatherUsageStats", "false",  # no telemetry from a serving box
            "--", *app_args]


def main(args: argparse.Namespace) -> int:
    require("streamlit", "mfs dashboard")         # the app runs in a child process: say it here, in one line
    if args.results and not Path(args.results).expanduser().is_file():
        print(f"mfs dashboard: results file not found: {args.results}", file=sys.stderr)
        return 2
    print(f"mfs dashboard: http://{args.address}:{args.port}  (Ctrl+C to stop)", file=sys.stderr)
    try:
        return subprocess.call(streamlit_command(args))
    except KeyboardInterrupt:  # Ctrl+C reaches streamlit too; it shuts itself down
        return 0
    except OSError as exc:
        print(f"mfs dashboard: cannot start streamlit ({exc})", file=sys.stderr)
        return 1
