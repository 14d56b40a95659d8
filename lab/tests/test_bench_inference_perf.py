"""``extproc bench inference-perf``: the configs it writes for inference-perf, the figures it reads
back and the router config of its session-cost rows (no inference-perf run: it needs its own venv)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.api import build_profile, config_from_mapping
from extproc_lab.bench.inference_perf import (
    CONFIGS,
    CONVERSATIONS,
    MULTI_TURN_CHAT,
    OURS,
    ROUND_ROBIN,
    SESSION_HEADER,
    SHARED_PREFIX,
    InferencePerfSetup,
    build_tokenizer,
    fleet_figures,
    format_table,
    request_figures,
    row_label,
    session_cost_config,
)

URL = "http://127.0.0.1:1"


def test_each_workload_config_targets_the_url_and_the_local_tokenizer(tmp_path: Path) -> None:
    setup = InferencePerfSetup()
    for workload, make in CONFIGS.items():
        cfg = make(setup, URL, tmp_path / "tok", tmp_path / "out")
        assert cfg["server"]["base_url"] == URL
        assert cfg["tokenizer"]["pretrained_model_name_or_path"] == str(tmp_path / "tok")
        assert cfg["api"]["streaming"] is True
        assert cfg["report"]["request_lifecycle"]["per_request"] is True, workload
    convo = CONFIGS[CONVERSATIONS](setup, URL, tmp_path, tmp_path)
    replay = convo["data"]["conversation_replay"]
    assert replay["shared_system_prompt_len"] == setup.system_tokens
    assert convo["load"]["stages"] == [
        {"num_requests": setup.conversations * setup.turns * setup.rounds, "concurrency_level": setup.conversations}
    ]
    assert convo["api"]["session_id_header_key"] == SESSION_HEADER
    no_header = CONFIGS[CONVERSATIONS](InferencePerfSetup(session_header=False), URL, tmp_path, tmp_path)
    assert "session_id_header_key" not in no_header["api"]
    prefix = CONFIGS[SHARED_PREFIX](setup, URL, tmp_path, tmp_path)["data"]["shared_prefix"]
    assert (prefix["num_groups"], prefix["system_prompt_len"]) == (setup.groups, setup.prefix_tokens)
    chat = CONFIGS[MULTI_TURN_CHAT](setup, URL, tmp_path, tmp_path)
    assert chat["data"]["shared_prefix"]["enable_multi_turn_chat"] is True
    stage = chat["load"]["stages"][0]
    assert stage["rate"] * stage["duration"] == setup.chat_groups * setup.chat_users * setup.chat_turns


def test_session_cost_rows_get_a_router_config_the_router_accepts() -> None:
    setup = InferencePerfSetup(session_tokens=(512, 2048))
    assert setup.rows() == [(OURS, None), (ROUND_ROBIN, None), (OURS, 512), (OURS, 2048)]
    # As the run writes it to the file it passes to `extproc serve --config`.
    config = config_from_mapping(yaml.safe_load(yaml.safe_dump(session_cost_config(2048), sort_keys=False)))
    build_profile(config.profile)
    scorers = {s["type"]: s for s in config.profile["scorers"]}
    assert scorers["prefill_cost"]["parameters"] == {"session_tokens": 2048}
    assert scorers["prefill_cost"]["weight"] == 3  # the rest of the default profile kept
    assert row_label(OURS, 2048) == "extproc (session_tokens=2048)"
    with pytest.raises(ValueError, match="unknown workloads"):
        InferencePerfSetup(workloads=("nope",)).check()


def test_figures_from_counters_and_per_request_token_times() -> None:
    before = {f"replica-{i}": {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0,
                               "vllm:request_success_total": 1.0} for i in range(3)}  # fmt: skip
    after = {
        "replica-0": {"vllm:prefix_cache_hits_total": 30.0, "vllm:prefix_cache_queries_total": 100.0,
                      "vllm:request_success_total": 5.0},
        "replica-1": {"vllm:prefix_cache_hits_total": 10.0, "vllm:prefix_cache_queries_total": 100.0,
                      "vllm:request_success_total": 1.0},
        "replica-2": {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0,
                      "vllm:request_success_total": 3.0},
    }  # fmt: skip
    fleet = fleet_figures(before, after)
    assert fleet == {
        "hit_ratio": 0.2,
        "requests_per_replica": {"replica-0": 4, "replica-1": 0, "replica-2": 2},
        "replicas_used": 2,
    }
    records: list[dict[str, Any]] = [
        {"start_time": 10.0, "info": {"response_metrics": {"output_token_times": [10.1, 10.5]}}, "error": None},
        {"start_time": 20.0, "info": {"response_metrics": {"output_token_times": [20.3, 21.0]}}, "error": None},
        {"start_time": 30.0, "info": None, "error": {"error_type": "timeout"}},
    ]
    timed = request_figures(records)
    assert timed["timed"] == 2
    assert timed["ttft_p99_s"] == pytest.approx(0.3) and timed["e2e_p99_s"] == pytest.approx(1.0)
    row = {"requests": 3, "failures": 1, "client_hit_ratio": 0.2, **timed, **fleet,
           "processor": {"decisions": {"prefix": 2, "sticky": 5}}}  # fmt: skip
    table = format_table({"runs": {CONVERSATIONS: {OURS: row, ROUND_ROBIN: {"error": "boom\ntail"}}}})
    assert "| conversations | extproc | 3 (1) | 20.0% |" in table
    assert "0 / 4 (2 of 3 used)" in table and "sticky 5, prefix 2" in table
    assert "| conversations | envoy_round_robin | failed: boom |" in table


def test_the_tokenizer_is_a_local_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path = build_tokenizer(tmp_path / "tok")
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = list(range(1, 401))
    text = tok.decode(ids)
    # About the fake replicas' 4 bytes a token, so a prompt's length reads about the same to both.
    assert 3.0 < len(text.encode()) / len(ids) < 6.0
