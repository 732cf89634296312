"""pipeline(..., parallel_config=...): generation in a pool of workers holding the tensor- / pipeline- / expert-parallel
model gives stand-alone's tokens (greedy, batched, streamed, seeded sampling) for GPT, T5 and GPT-MoE; each rank holds
its share of the weights and KV cache; the pool persists across calls, closes with the pipeline, and a killed worker
ends the call with one line (the next call starts a new pool); the CLI predicts with a layout."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TextIteratorStreamer

import mindformers_py as mf
from support.dist_utils import process_alive
from mindformers_py.cli import main
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer
from mindformers_py.errors import ConfigError
from mindformers_py.parallel.inference import cache_bytes, local_bytes
from mindformers_py.launcher.launch import LaunchError

PROMPTS = ["def main(", "hello world, the quick"]
T5_FOLDER = Path(__file__).resolve().parents[1] / "fixtures" / "t5_pipelines"
GREEDY = dict(max_new_tokens=8, do_sample=False)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """A tiny llama-flavoured GPT (4 layers mixing sliding-window and full attention, as Qwen2 and Gemma do, so each
    pipeline stage must keep its layers' kinds; a wide initialisation, so greedy choices are not near-ties) saved
    with its tokenizer, and the stand-alone pipeline's outputs."""
    folder = tmp_path_factory.mktemp("gpt")
    texts = ["def main():\n    return 0\n", "hello world, hello there", "the quick brown fox jumps over the dog"] * 10
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300, save_dir=folder)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(
        flavour="llama", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).eval()
    model.save_pretrained(folder)
    pipe = mf.pipeline("text-generation", model=str(folder))
    expected = {"single": [pipe(p, **GREEDY)[0]["generated_text"] for p in PROMPTS],
                "batched": pipe(PROMPTS, batch_size=2, **GREEDY),
                "weights": local_bytes(model), "kv_per_token": _kv_per_token(model)}
    return folder, expected


def _kv_per_token(model) -> int:
    with torch.inference_mode():
        out = model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=True)
    return cache_bytes(out["cache"] if "cache" in out else out["past_key_values"]) // 8


def _streamed(pipe, prompt: str, **kwargs) -> str:
    streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(target=pipe, args=(prompt,), kwargs=dict(streamer=streamer, **(kwargs or GREEDY)))
    worker.start()
    text = "".join(streamer)
    worker.join()
    return text


LAYOUTS = {
    "tp2_vocab_parallel": ({"model_parallel": 2, "vocab_emb_dp": False}, 2, 1),
    "pp2": ({"pipeline_stage": 2}, 1, 2),
    "tp2_pp2": ({"model_parallel": 2, "pipeline_stage": 2}, 2, 2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_gpt_generates_stand_alone_tokens_with_sharded_weights_and_cache(name, gpt):
    folder, expected = gpt
    layout, tp, pp = LAYOUTS[name]
    with mf.pipeline("text-generation", model=str(folder), parallel_config=layout) as pipe:
        pids = pipe.model.pool.pids
        assert len(pids) == tp * pp
        assert [pipe(p, **GREEDY)[0]["generated_text"] for p in PROMPTS] == expected["single"]
        assert pipe(PROMPTS, batch_size=2, **GREEDY) == expected["batched"]
        assert _streamed(pipe, PROMPTS[0]) == expected["single"][0][len(PROMPTS[0]):]
        assert pipe.model.pool.pids == pids  # the same workers served every call
        memory = pipe.model.pool.memory()
    assert not any(process_alive(pid) for pid in pids)  # closed with the pipeline
    # Each rank holds 1/(tp*pp) of the heads' cache; its weights are less than the whole model's.
    assert all(m["kv_cache_bytes_per_token"] * tp * pp == expected["kv_per_token"] for m in memory)
    assert all(m["weights_bytes"] < expected["weights"] for m in memory)
    assert sum(m["weights_bytes"] for m in memory) >= expected["weights"]


def test_t5_summarizes_with_stand_alone_tokens_on_two_tensor_parallel_ranks():
    texts = ["def area(width, height):\n    return width * height", "read the lines of a file"]
    kwargs = dict(max_new_tokens=8, num_beams=1, do_sample=False)
    expected = mf.pipeline("summarization", model=str(T5_FOLDER))(texts, **kwargs)
    pipe = mf.pipeline("summarization", model=str(T5_FOLDER), parallel_config=mf.ParallelConfig(model_parallel=2))
    try:
        assert pipe(texts, **kwargs) == expected
        assert pipe(texts, batch_size=2, **kwargs) == expected
        assert _streamed(pipe, texts[0], **kwargs).strip() == expected[0]["summary_text"].strip()
    finally:
        pipe.close()


def test_moe_with_expert_parallelism_generates_and_samples_as_stand_alone(gpt):
    folder, _ = gpt
    tokenizer = mf.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        initializer_range=0.2, moe_config={"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless",
                                           "moe_intermediate_size": 32},
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).eval()
    sampling = dict(max_new_tokens=8, do_sample=True, top_k=20)
    alone = mf.pipeline("text-generation", model=model, tokenizer=tokenizer)
    greedy = alone(PROMPTS, batch_size=2, **GREEDY)
    torch.manual_seed(5)
    sampled = alone(PROMPTS[0], **sampling)
    layout = mf.ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=2, expert_parallel=2)
    with mf.pipeline("text-generation", model=model, tokenizer=tokenizer, parallel_config=layout) as pipe:
        assert pipe(PROMPTS, batch_size=2, **GREEDY) == greedy
        assert _streamed(pipe, PROMPTS[0]) == alone(PROMPTS[0], **GREEDY)[0]["generated_text"][len(PROMPTS[0]):]
        torch.manual_seed(5)
        assert pipe(PROMPTS[0], **sampling) == sampled  # the workers draw from this process's random state


def test_a_killed_worker_ends_the_call_and_the_next_call_starts_a_new_pool(gpt):
    folder, expected = gpt
    with mf.pipeline("text-generation", model=str(folder), parallel_config={"model_parallel": 2}) as pipe:
        os.kill(pipe.model.pool.pids[1], signal.SIGKILL)
        with pytest.raises(LaunchError) as err:
            pipe(PROMPTS[0], **GREEDY)
        assert "\n" not in str(err.value) and "rank 1" in str(err.value) and "SIGKILL" in str(err.value)
        assert pipe(PROMPTS[0], **GREEDY)[0]["generated_text"] == expected["single"][0]


def test_layouts_that_do_not_apply_to_generation_are_refused_in_one_line(gpt):
    folder, _ = gpt
    cases = {"data_parallel=2 is not valid for generation": {"data_parallel": 2},
             "use_seq_parallel=True does not apply": {"model_parallel": 2, "use_seq_parallel": True},
             "context_parallel=2 does not apply to generation": {"context_parallel": 2},
             "applies to the generating pipelines": None}
    for message, layout in cases.items():
        with pytest.raises(mf.MindFormersError, match=message):
            if layout is None:
                mf.pipeline("feature-extraction", model=str(folder), parallel_config={"model_parallel": 2})
            else:
                mf.pipeline("text-generation", model=str(folder), parallel_config=layout)
    with pytest.raises(ConfigError, match="pipeline_stage=2 is not supported for generation with an encoder-decoder"):
        mf.pipeline("summarization", model=str(T5_FOLDER), parallel_config={"pipeline_stage": 2})


def test_cli_predicts_with_a_layout(gpt, tmp_path, capsys):
    folder, expected = gpt
    recipe = {"run_mode": "predict", "model": {"name_or_path": str(folder)}, "data": {"block_size": 32},
              "training": {"output_dir": str(tmp_path / "out")},
              "generate": {"prompts": PROMPTS, "max_new_tokens": GREEDY["max_new_tokens"]},
              "parallel": {"parallel_mode": "semi_auto_parallel", "model_parallel": 2}}
    path = tmp_path / "predict.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["run", str(path)]) == 0, capsys.readouterr().err
    samples = (tmp_path / "out" / "predictions.txt").read_text()
    assert all(text in samples for text in expected["single"])
