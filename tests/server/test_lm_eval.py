"""lm-evaluation-harness against the server, offline, as its users run it: a multiple-choice task
through ``local-completions`` (loglikelihoods from echoed prompt log-probabilities, the tokenizer
read remotely from ``/tokenizer_info``, ``/tokenize``, ``/detokenize``) and a ``generate_until``
task through ``local-completions`` and ``local-chat-completions``; per-sample loglikelihoods equal
``lm_eval --model hf`` on the same checkpoint within 1e-3, and greedy generations are the same."""

from __future__ import annotations

import json

import pytest

from .conftest import ServerProcess

QUESTIONS = [
    ("What does a prefill unit compute?", ["the KV cache", "the weather", "a poem"], 0),
    ("Where do the experts live?", ["on GPUs", "in the sea", "nowhere at all"], 0),
    ("What moves tokens between GPUs?", ["the all-to-all", "a bicycle", "the decode unit"], 0),
]
PROMPTS = [("Prefill and decode are", "disaggregated"), ("The decode unit runs", "EP144")]


def _tasks(folder) -> None:
    """Two tasks on local JSON data, as lm-eval's custom task YAML describes them."""
    data = folder / "data"
    data.mkdir()
    with open(data / "mc.jsonl", "w") as f:
        for q, choices, label in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "label": label}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for q, a in PROMPTS:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data / 'gen.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def server(tiny_bpe):
    srv = ServerProcess(["--model", str(tiny_bpe), "--colocated-units", "1",
                         "--prefill-units", "0", "--decode-units", "0", "--colocated-ranks", "1",
                         "--block-size", "16", "--num-kv-blocks", "256"])  # fmt: skip
    yield srv
    assert srv.stop() == 0, "".join(srv.log)


@pytest.mark.timeout(600)
def test_lm_eval_scores_through_the_server_as_through_transformers(
    server, tiny_bpe, tmp_path, monkeypatch
):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OPENAI_API_KEY", "none")
    import lm_eval
    from lm_eval.tasks import TaskManager

    _tasks(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))

    def run(model: str, model_args: dict, names: list[str], **kwargs) -> dict:
        out = lm_eval.simple_evaluate(
            model=model, model_args=model_args, tasks=names, task_manager=tasks,
            batch_size=1, bootstrap_iters=0, log_samples=True, **kwargs,
        )  # fmt: skip
        return {
            task: sorted(rows, key=lambda r: r["doc_id"]) for task, rows in out["samples"].items()
        }

    remote = {"model": "tiny", "tokenizer_backend": "remote", "tokenized_requests": True,
              "max_length": 256, "max_retries": 1, "num_concurrent": 1}  # fmt: skip
    ours = run("local-completions", remote | {"base_url": f"{server.url}/v1/completions"},
               ["tiny_mc", "tiny_gen"])  # fmt: skip
    chat = run("local-chat-completions",
               {"model": "tiny", "base_url": f"{server.url}/v1/chat/completions", "max_retries": 1},
               ["tiny_gen"], apply_chat_template=True)  # fmt: skip
    hf = {"pretrained": str(tiny_bpe), "dtype": "float32", "device": "cpu"}
    reference = run("hf", hf, ["tiny_mc", "tiny_gen"])
    reference_chat = run("hf", hf, ["tiny_gen"], apply_chat_template=True)

    scored = [(float(a[0]), float(b[0]), a[1], b[1])
              for got, want in zip(ours["tiny_mc"], reference["tiny_mc"], strict=True)
              for a, b in zip(got["filtered_resps"], want["filtered_resps"], strict=True)]  # fmt: skip
    assert len(scored) == sum(len(q[1]) for q in QUESTIONS)
    assert max(abs(a - b) for a, b, _, _ in scored) < 1e-3
    assert [str(x) for *_, x, _ in scored] == [str(y) for *_, y in scored]  # is_greedy
    assert all(a < 0 for a, *_ in scored)

    def generated(samples) -> list[str]:
        # a generation cut by max_gen_toks inside a UTF-8 character: transformers' whole-text
        # decode shows U+FFFD, a server's stream (vLLM's too) holds the incomplete bytes back
        return [r["filtered_resps"][0].rstrip("\ufffd") for r in samples["tiny_gen"]]

    assert generated(ours) == generated(reference) and all(generated(ours))
    assert generated(chat) == generated(reference_chat) and all(generated(chat))
