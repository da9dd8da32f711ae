"""Request parsing rules of the chat server (pure functions: no model needed)."""

from __future__ import annotations

import pytest

from fluxion_lite.server.metrics import Histogram, Metrics
from fluxion_lite.server.protocol import ApiError, parse_chat, parse_completion, parse_detokenize, parse_tokenize

MSG = [{"role": "user", "content": "hi"}]


def test_chat_fields_are_parsed_into_sampling_kwargs() -> None:
    req = parse_chat({"model": "m", "messages": MSG, "max_tokens": 7, "temperature": 0, "top_k": 5, "min_p": 0.1,
                      "seed": 3, "stop": "END", "stream": True, "stream_options": {"include_usage": True},
                      "user": "ignored-bookkeeping"})
    assert req.stream and req.include_usage and req.model == "m"
    assert req.sampling.as_kwargs() == {"max_tokens": 7, "temperature": 0.0, "top_k": 5, "min_p": 0.1, "seed": 3,
                                        "stop": ["END"], "ignore_eos": False}


def test_unset_fields_are_left_to_engine_defaults() -> None:
    assert parse_chat({"messages": MSG}).sampling.as_kwargs() == {"stop": [], "ignore_eos": False}


def test_text_parts_are_joined_and_developer_maps_to_system() -> None:
    req = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]})
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "ab")]


def test_max_completion_tokens_is_an_alias_and_must_agree() -> None:
    assert parse_chat({"messages": MSG, "max_completion_tokens": 9}).sampling.max_tokens == 9
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": MSG, "max_tokens": 8, "max_completion_tokens": 9})
    assert err.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": MSG, "temperature": True}, "temperature", "invalid_type"),
        ({"messages": MSG, "top_k": 1.5}, "top_k", "invalid_type"),
        ({"messages": MSG, "top_p": 1.5}, "top_p", "invalid_value"),
        ({"messages": MSG, "stop": ["a", 1]}, "stop", "invalid_type"),
        ({"messages": MSG, "stop": [""]}, "stop", "invalid_value"),
        ({"messages": MSG, "stop": ["x"] * 17}, "stop", "invalid_value"),
        ({"messages": MSG, "logprobs": True}, "logprobs", "unsupported_parameter"),
        ({"messages": MSG, "tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
        ({"messages": MSG, "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ({"messages": MSG, "stream": True, "stream_options": {"bogus": 1}}, "stream_options", "unknown_parameter"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0]", "unknown_parameter"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "invalid_type"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        ({"messages": MSG, "model": 5}, "model", "invalid_type"),
    ],
)
def test_chat_rejections_name_the_field(body: dict, param: str, code: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat(body)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)
    assert param.split("[")[0] in err.value.message


def test_completion_prompt_forms() -> None:
    assert parse_completion({"prompt": "abc"}).prompt == "abc"
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"prompt": ["one"]}).prompt == "one"  # a batch of one
    for bad, code in (({"prompt": ["a", "b"]}, "unsupported_parameter"), ({"prompt": [1, "a"]}, "invalid_type"),
                      ({"prompt": ""}, "empty_prompt"), ({"prompt": "x", "echo": True}, "unsupported_parameter"),
                      ({"prompt": "x", "best_of": 3}, "unsupported_parameter")):
        with pytest.raises(ApiError) as err:
            parse_completion(bad)
        assert err.value.code == code, bad


def test_tokenize_and_detokenize_bodies() -> None:
    assert parse_tokenize({"content": "x"}) == ("x", True)
    assert parse_tokenize({"content": "x", "add_special": False}) == ("x", False)
    assert parse_detokenize({"tokens": [0, 9]}, vocab_size=10) == [0, 9]
    with pytest.raises(ApiError) as err:
        parse_detokenize({"tokens": [10]}, vocab_size=10)
    assert err.value.param == "tokens[0]"


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    lines = h.render("x", "help")
    assert 'x_bucket{le="0.1"} 1' in lines and 'x_bucket{le="1"} 3' in lines and 'x_bucket{le="+Inf"} 4' in lines
    assert "x_count 4" in lines


def test_metrics_render_engine_gauges_and_sparse_stats() -> None:
    m = Metrics()
    m.record_finished(prompt_tokens=10, completion_tokens=5, cached_tokens=4, finish_reason="stop", ttft_s=0.2,
                      decode_s=0.4, e2e_s=0.6)
    text = m.render({"ready": 1, "waiting": 3, "kv_bytes_host": 123456789, "sparse": {"density": 0.05},
                     "steps": {"mixed_steps": 7, "mixed_s": 0.25}})
    assert "fluxion_queue_depth 3" in text
    assert "fluxion_kv_cache_host_bytes 123456789" in text
    assert 'fluxion_sparse_stat{name="density"} 0.05' in text
    assert 'fluxion_engine_step_stat{name="mixed_steps"} 7' in text
    assert 'fluxion_engine_step_stat{name="mixed_s"} 0.25' in text
    assert "fluxion_prefix_cached_tokens_total 4" in text
    assert "fluxion_time_per_output_token_seconds_sum 0.100000" in text  # 0.4 s over 4 inter-token gaps
