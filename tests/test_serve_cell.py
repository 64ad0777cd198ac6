"""ServeCell driven from Python: start, live counters, busy badge, stop, restart."""

from __future__ import annotations

import socket

import pytest

from tests.support.polling import wait_for

openai = pytest.importorskip("openai")


@pytest.mark.slow
def test_serve_cell_serves_counts_and_stops(smollm2):
    from workbench.widgets import ServeCell

    cell = ServeCell(smollm2, model_id="smol", port=0)
    try:
        assert cell.running and cell.base_url.endswith("/v1")
        assert cell.base_url in cell.url_label.value
        assert cell.start_button.disabled and not cell.stop_button.disabled
        assert "0 requests answered" in cell.counters.value
        client = openai.OpenAI(base_url=cell.base_url, api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        busy_seen = []
        unsubscribe = smollm2.busy.subscribe(lambda v: busy_seen.append(cell.badges[0].busy))
        r = client.chat.completions.create(model="smol", messages=messages, temperature=0,
                                           max_tokens=12)
        unsubscribe()
        assert r.choices[0].message.content == smollm2.chat(messages, temperature=0,
                                                            max_tokens=12).text
        assert True in busy_seen  # the badge followed the model while the server used it
        assert wait_for(lambda: "1 requests answered · 0 running · 0 queued"
                        in cell.counters.value, 10), cell.counters.value
        url = cell.base_url
        cell.stop()
        assert not cell.running and "stopped" in cell.url_label.value
        assert not cell.start_button.disabled and cell.stop_button.disabled
        with pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=url, api_key="-", max_retries=0).models.list()
        cell.start()  # again, on the port it had: the client made for it still works
        assert cell.running and cell.base_url == url
        assert [m.id for m in client.models.list()] == ["smol"]
        # a port another program holds: Start says so in the cell
        with socket.create_server(("127.0.0.1", 0)) as taken:
            busy = ServeCell(smollm2, model_id="smol", port=taken.getsockname()[1],
                             autostart=False)
            busy.start_button.click()
            assert not busy.running and "could not start" in busy.url_label.value
            assert "cannot listen" in busy.url_label.value
            busy.close()
    finally:
        cell.close()
    assert not cell.running
