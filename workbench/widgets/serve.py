"""`ServeCell`: start and stop the OpenAI-compatible server from a notebook cell.

    cell = ServeCell(m, port=0)         # starts serving; Stop / Start buttons
    client = openai.OpenAI(base_url=cell.base_url, api_key="-")

The cell shows the server's URL, how many requests it has answered, how many
run and wait right now, and a busy badge per served model. Options are
`workbench.serve`'s.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import ipywidgets

from workbench.server.runner import Server, default_model_id, serve
from workbench.widgets.badges import BusyBadge


class ServeCell(ipywidgets.VBox):
    """A running server in a cell: the URL (`.url_label`), live counters (`.counters`), a
    busy badge per model (`.badges`), and Start / Stop buttons (`.start_button`,
    `.stop_button`)."""

    def __init__(self, engine: Any | Mapping[str, Any], *, model_id: str | None = None,
                 autostart: bool = True, **serve_options: Any):
        self.engines = dict(engine) if isinstance(engine, Mapping) else {
            model_id or default_model_id(engine): engine}
        self.options = dict(serve_options)
        self.options.pop("background", None)
        self.server: Server | None = None
        self._unsubscribe: list = []
        self.url_label = ipywidgets.HTML("")
        self.counters = ipywidgets.HTML("")
        self.badges = [BusyBadge(e) for e in self.engines.values() if hasattr(e, "busy")]
        names = [ipywidgets.HTML(f"<code>{html.escape(m)}</code>") for m, e in
                 self.engines.items() if hasattr(e, "busy")]
        self.start_button = ipywidgets.Button(description="Start", icon="play")
        self.stop_button = ipywidgets.Button(description="Stop", icon="stop")
        self.start_button.on_click(lambda _: self._start_clicked())
        self.stop_button.on_click(lambda _: self.stop())
        models = ipywidgets.HBox([w for pair in zip(names, self.badges) for w in pair])
        super().__init__(children=[
            ipywidgets.HBox([self.start_button, self.stop_button, self.url_label]),
            models, self.counters])
        self.add_class("wb-serve")
        self._show()
        if autostart:
            self.start()

    # -- public API ----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.server is not None and self.server.is_running

    @property
    def url(self) -> str:
        """The server's root URL ("" when stopped)."""
        return self.server.url if self.running else ""

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as `base_url` (the URL + "/v1"; "" when stopped)."""
        return self.server.base_url if self.running else ""

    def start(self) -> Server:
        """Start serving (a no-op while running); returns the `Server`. Started again
        after `stop`, a server asked for a free port (`port=0`) takes the port it had, so
        clients made for its `base_url` still reach it."""
        if self.running:
            return self.server
        options = dict(self.options)
        if self.server is not None and options.get("port") == 0:
            options["port"] = self.server.port
        self.server = serve(self.engines, background=True, **options)
        for signal in (self.server.requests, self.server.running, self.server.queued):
            self._unsubscribe.append(signal.subscribe(lambda _: self._show()))
        self._show()
        return self.server

    def stop(self) -> None:
        """Stop serving (running generations end after their current token)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self.server is not None:
            self.server.stop()
        self._show()

    def close(self) -> None:
        """Stop the server and close the widgets."""
        self.stop()
        for badge in self.badges:
            badge.close()
        super().close()

    # -- internals -----------------------------------------------------------------------------
    def _start_clicked(self) -> None:
        try:
            self.start()
        except Exception as exc:  # noqa: BLE001 - shown in the cell (a busy port ...)
            self.url_label.value = (f"<span class='wb-error'>could not start: "
                                    f"{html.escape(str(exc))}</span>")

    def _show(self) -> None:
        running = self.running
        self.start_button.disabled = running
        self.stop_button.disabled = not running
        if not running:
            self.url_label.value = "<span class='wb-serve-url'>stopped</span>"
            self.counters.value = ""
            return
        url = html.escape(self.server.base_url)
        self.url_label.value = (f"<span class='wb-serve-url'>serving at "
                                f"<a href='{url}/models' target='_blank'>{url}</a></span>")
        s = self.server
        self.counters.value = (f"<span class='wb-serve-counters'>{s.requests.peek()} requests "
                               f"answered · {s.running.peek()} running · "
                               f"{s.queued.peek()} queued</span>")
