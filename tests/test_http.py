import httpx
import numpy as np

from client import ReplayClient
from service.grpc_server.server import ReplayServer
from tests.conftest import TEST_INSTANCE


def test_health_metrics_buffers_and_status_page() -> None:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}http", http_address="127.0.0.1:0").start()
    try:
        base = f"http://127.0.0.1:{server.http.port}"
        with ReplayClient(server.address) as client:
            client.create_buffer("cp", 1000, {"obs": ("float32", (4,)), "action": ("int64", ()),
                                              "reward": ("float32", ())})
            client.insert_episode("cp", True, obs=np.zeros((11, 4), np.float32), action=np.zeros(10, np.int64),
                                  reward=np.ones(10, np.float32))
            client.sample("cp", 8)
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{base}/readyz").json()["buffers"] == 1
        buffers = httpx.get(f"{base}/api/buffers").json()["buffers"]
        assert buffers[0]["name"] == "cp" and buffers[0]["stored_steps"] == 11 and buffers[0]["sampled_items"] == 8
        metrics = httpx.get(f"{base}/metrics").text
        assert 'replayd_buffer_stored_steps{buffer="cp"} 11.0' in metrics
        assert 'replayd_buffer_counter{buffer="cp",counter="sampled_items"} 8.0' in metrics
        page = httpx.get(base).text
        assert "<title>replayd</title>" in page and "api/buffers" in page
    finally:
        server.stop(grace=0)
