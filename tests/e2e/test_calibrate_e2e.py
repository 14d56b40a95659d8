"""``extproc calibrate`` against the fake replica, whose speeds are known (its profile's), and the
prior it writes read back by the router's strict config: the rate learner and the price both
start from it. The same command against real vLLM is in ``tests/e2e/test_vllm_timing_e2e.py``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.adapters.cli import main
from extproc.app.router import Router
from extproc.config import config_from_mapping
from extproc_lab.demo.processes import ProcessGroup, free_port, wait_for_http
from extproc_lab.replica.timing import LLAMA_8B_A100

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "extproc", "replica", "--name", "r0", "--port", str(port)]
    with ProcessGroup(tmp_path_factory.mktemp("calibrate")) as procs:
        procs.start("r0", [*argv, "--profile", LLAMA_8B_A100.name])
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/health")
        yield url


def test_calibrate_measures_the_fake_replicas_profile_and_writes_a_prior_the_config_takes(
    replica: str, tmp_path: Path
) -> None:
    out = tmp_path / "prior.yaml"
    argv = ["calibrate", "--url", replica, "--pool", "a100", "--repeats", "1", "--out", str(out)]
    assert main([*argv, "--prompt-tokens", "128,512,1024,1536"]) == 0
    text = out.read_text()
    print(text)
    assert "cached" in text  # the cached figures are reported beside the prior
    cfg = config_from_mapping(yaml.safe_load(text))
    (prior,) = cfg.health.engine_rates
    profile = LLAMA_8B_A100
    assert prior.labels == {"pool": "a100"}
    # The profile's rates, within what a loaded 2-core machine adds to each request.
    assert prior.prefill_tokens_per_s == pytest.approx(profile.prefill_tokens_per_s, rel=0.35)
    assert prior.decode_step_s == pytest.approx(profile.decode_s_per_token, rel=0.35)
    assert prior.overhead_s == pytest.approx(profile.ttft_overhead_s, abs=0.02)
    assert 0.0 <= prior.decode_per_seq_s < profile.decode_s_per_token
    # One place: the rate learner and the price's view start a replica of the pool from it.
    router = Router(cfg)
    assert router.rates.rates("r", {"pool": "a100"}).prefill_tokens_per_s == prior.prefill_tokens_per_s
    assert router.latency.view().priors[0].rates.decode_step_s == prior.decode_step_s


def test_calibrate_refuses_a_bad_label(replica: str) -> None:
    assert main(["calibrate", "--url", replica, "--label", "nolabel"]) == 2
