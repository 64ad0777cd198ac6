"""`workbench lab`: JupyterLab on the repository's notebooks, quiet and offline.

The terminal shows one URL to open (with a token of ours, handed to JupyterLab in
$JUPYTER_TOKEN rather than on its command line, where `ps` would show it), the
progress of the default model's CPU kernels compiling in a helper process, and
JupyterLab's warnings and errors; nothing else. Everything is set through
JupyterLab's own configuration:

- the kernels' "running over TCP without encryption" warning: jupyter_server
  provisions CurveZMQ keys for the kernels whose kernel spec supports them
  (ipykernel's does), so their traffic is encrypted and they have nothing to warn of;
- the "official Jupyter news?" popup: the default of the notification plugin's
  `fetchNews` and `checkForUpdates` settings is "off", through a
  `labconfig/default_setting_overrides.json` in a configuration directory of ours
  added to $JUPYTER_CONFIG_PATH. A default only: what the user chose in their own
  settings still wins, and nothing is written to their ~/.jupyter.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from workbench import registry

NOTIFICATION_PLUGIN = "@jupyterlab/apputils-extension:notification"
# defaults for JupyterLab's settings (its users' own settings override them)
SETTING_DEFAULTS = {NOTIFICATION_PLUGIN: {"fetchNews": "false", "checkForUpdates": False}}
SERVER_START_S = 120  # how long to wait for JupyterLab's server info before saying so


def lab_command(notebooks: Path, notebook: str, *, port: int | None = None,
                no_browser: bool = False) -> list[str]:
    """The JupyterLab command line `workbench lab` runs: offline (no news, no update checks),
    logging warnings and errors only, its kernels' transport encrypted."""
    cmd = [sys.executable, "-m", "jupyterlab",
           f"--ServerApp.root_dir={notebooks}",
           f"--ServerApp.default_url=/lab/tree/{notebook}",
           f"--LabApp.default_url=/lab/tree/{notebook}",
           "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly",
           "--ServerApp.log_level=WARN",  # we print the URL ourselves (see `run`)
           "--LabApp.log_level=WARN",
           "--ServerApp.answer_yes=True"]  # one Ctrl-C stops the server, no y/n prompt
    if _has_curve():  # else jupyter_client refuses the setting and JupyterLab does not start
        cmd.append("--MappingKernelManager.transport_encryption=auto")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers often run as root
        cmd.append("--ServerApp.allow_root=True")
    if port is not None:
        cmd.append(f"--ServerApp.port={port}")
    if no_browser:
        cmd.append("--ServerApp.open_browser=False")
    return cmd


def _has_curve() -> bool:
    try:
        import zmq
    except ImportError:
        return False
    return bool(zmq.has("curve"))


def lab_environment(config_dir: Path, token: str, base: dict | None = None) -> dict[str, str]:
    """The environment JupyterLab runs in: `base` (default os.environ) with `token` as
    $JUPYTER_TOKEN (unless the user set one) and `config_dir` first on
    $JUPYTER_CONFIG_PATH, where this writes `labconfig/default_setting_overrides.json`
    (`SETTING_DEFAULTS`)."""
    env = dict(os.environ if base is None else base)
    labconfig = config_dir / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "default_setting_overrides.json").write_text(
        json.dumps(SETTING_DEFAULTS, indent=2) + "\n")
    env.setdefault("JUPYTER_TOKEN", token)
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        [str(config_dir), *filter(None, [env.get("JUPYTER_CONFIG_PATH")])])
    return env


def server_url(info: dict, notebook: str) -> str:
    """The URL that opens `notebook` on the server of `info` (its jpserver-PID.json),
    with the token."""
    url = f"{info['url'].rstrip('/')}/lab/tree/{notebook}"
    return f"{url}?token={info['token']}" if info.get("token") else url


def _server_info(pid: int) -> dict | None:
    """The server info file JupyterLab (process `pid`) writes once it listens, or None."""
    from jupyter_core.paths import jupyter_runtime_dir

    try:
        return json.loads((Path(jupyter_runtime_dir()) / f"jpserver-{pid}.json").read_text())
    except (OSError, ValueError):
        return None


# -- the kernels' helper process ---------------------------------------------------------------
def kernels_command(alias: str) -> list[str]:
    """The helper process that prepares `alias`'s CPU kernels (`python -m workbench.lab
    kernels ALIAS`, see `prepare_kernels`)."""
    return [sys.executable, "-m", "workbench.lab", "kernels", alias]


def prepare_kernels(alias: str, file=None) -> None:
    """Compile (or load from the cache) the CPU kernels of the model `alias`, writing a line
    for each step that takes over a second ("kernels: compiling 3/6: prefill") and
    "kernels ready in N s" at the end, or nothing at all when the cache had them."""
    from workbench.engine import load_engine
    from workbench.engine.runtime.warmup import QUIET_SECONDS

    file = file or sys.stdout
    engine = load_engine(alias)
    shown = -1
    began = time.monotonic()
    while not engine.warmup.wait(QUIET_SECONDS / 2):
        state = engine.warming.peek()
        if state is None or state.done == shown:
            continue
        if time.monotonic() - began >= QUIET_SECONDS:
            shown = state.done
            print(f"kernels: compiling {state.done}/{state.total}: {state.task}", file=file,
                  flush=True)
    if shown >= 0:
        print(f"kernels ready in {engine.warmup.seconds:.0f} s", file=file, flush=True)


class Helper:
    """A background process whose output lines go to `echo` (prefixed) and which is reaped
    when it ends (a thread waits for it), or terminated with its process group by
    `stop()`."""

    def __init__(self, cmd: Sequence[str], echo: Callable[[str], None], prefix: str = ""):
        # in a session of its own: a Ctrl-C in the terminal is JupyterLab's, not its
        self.proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._echo, self._prefix = echo, prefix
        self._thread = threading.Thread(target=self._follow, name="workbench-lab-helper",
                                        daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        with self.proc.stdout:
            for line in self.proc.stdout:
                if line.strip():
                    self._echo(self._prefix + line.rstrip())
        self.proc.wait()

    def stop(self, timeout: float = 5) -> int:
        """Terminate the process (and the ones it started) if it still runs; its exit
        status once reaped."""
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._thread.join(timeout)
        return self.proc.wait()


def _say(text: str) -> None:
    print(f"workbench lab: {text}", file=sys.stderr, flush=True)


# -- the command -----------------------------------------------------------------------------
def run(notebooks: Path, notebook: str, *, port: int | None = None,
        no_browser: bool = False) -> int:
    """Run JupyterLab on `notebooks`, opening `notebook`, until it exits (Ctrl-C or
    SIGTERM), with the default model's kernels prepared in a helper process meanwhile; its
    exit status."""
    token = secrets.token_hex(24)
    with tempfile.TemporaryDirectory(prefix="workbench-lab-") as config_dir:
        env = lab_environment(Path(config_dir), token)
        # the kernels compile (or load from the cache) while JupyterLab starts, so that the
        # tour's first cell finds them ready
        helper = Helper(kernels_command(registry.DEFAULT_MODEL), _say)
        proc = subprocess.Popen(lab_command(notebooks, notebook, port=port,
                                            no_browser=no_browser), cwd=notebooks, env=env)
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            shown, began = False, time.monotonic()
            while True:
                try:
                    if shown:
                        return proc.wait()
                    code = _wait(proc, 0.2)
                    if code is not None:
                        return code
                    info = _server_info(proc.pid)
                    if info is not None:
                        print(f"JupyterLab is at {server_url(info, notebook)}", flush=True)
                        print("(Ctrl-C stops it)", file=sys.stderr, flush=True)
                        shown = True
                    elif time.monotonic() - began > SERVER_START_S:
                        _say("JupyterLab has not said where it listens; see its log above")
                        shown = True
                except KeyboardInterrupt:  # JupyterLab gets the Ctrl-C too and shuts down
                    continue
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:  # we were terminated: take JupyterLab down with us
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            helper.stop()


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """The helper process: `python -m workbench.lab kernels ALIAS`."""
    command, alias = argv if argv is not None else sys.argv[1:]
    if command != "kernels":
        raise SystemExit(f"unknown command {command!r}")
    prepare_kernels(alias)
    return 0


if __name__ == "__main__":
    sys.exit(main())
