"""KV connectors: a hand-off's blocks read by the decode rank through the Mooncake Transfer Engine
(TCP, P2P handshake) give the same tokens as ``transformers``; what a reader may not read."""

from __future__ import annotations

import msgspec
import pytest
import torch

from moeinfra.engine.handoff import Handoff
from moeinfra.engine.sampling import SamplingParams
from moeinfra.errors import InputError
from moeinfra.server.kv_connector import check_connector, make_connector
from moeinfra.server.kv_transfer import TransferError, verify
from moeinfra.server.messages import decode_kv_header

from .conftest import disaggregated

pytest.importorskip(
    "mooncake.engine", reason="the Mooncake Transfer Engine (moeinfra[mooncake], libibverbs1)"
)

PROMPTS = [
    "The prefill unit lends its blocks and the decode unit reads them",
    "Mooncake moves KV caches between hosts over TCP or RDMA",
    "x",
]


def handoff(request_id: str, tokens: int, seed: int) -> Handoff:
    kv = torch.randn(3, tokens, 40, generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(max_tokens=4)
    return Handoff(request_id, list(range(tokens)), [7], params, kv, 0, "", [], None)


@pytest.fixture(scope="module")
def pair():
    lender, reader = (
        make_connector("mooncake", "127.0.0.1"),
        make_connector("mooncake", "127.0.0.1"),
    )
    yield lender, reader
    lender.close()
    reader.close()


def test_blocks_read_through_mooncake_are_the_prompts_kv(pair):
    lender, reader = pair
    sent = handoff("r1", 37, 0)
    frames = lender.frames(sent, block_size=16)
    assert len(frames) == 1  # the header only: the blocks stay lent
    header = decode_kv_header(frames[0])
    assert header.source == lender.session and header.address
    arrival = verify(header, reader.fetch(header), 3, 40, torch.float32)
    assert torch.equal(arrival.preloaded.kv, sent.kv)
    assert arrival.prompt_ids == sent.prompt_ids and arrival.output_ids == [7]
    lender.release("r1")
    assert "r1" not in lender.lent


def test_a_released_or_foreign_address_cannot_be_read(pair):
    lender, reader = pair
    header = decode_kv_header(lender.frames(handoff("r2", 20, 1), block_size=16)[0])
    lender.release("r2")
    with pytest.raises(TransferError, match="request r2: reading its KV blocks from"):
        reader.fetch(header)
    # memory the lender never lent is refused by the lender's engine, not read
    other = decode_kv_header(lender.frames(handoff("r3", 20, 2), block_size=16)[0])
    foreign = msgspec.structs.replace(other, address=other.address + (1 << 32))
    with pytest.raises(TransferError, match="over Mooncake failed"):
        reader.fetch(foreign)
    lender.release("r3")


def test_damaged_blocks_fail_their_checksum(pair):
    lender, reader = pair
    sent = handoff("r4", 20, 3)
    header = decode_kv_header(lender.frames(sent, block_size=16)[0])
    lender.lent["r4"][0][5] ^= 0xFF  # the lent memory changes before the read
    with pytest.raises(TransferError, match="KV block 0 is damaged"):
        verify(header, reader.fetch(header), 3, 40, torch.float32)
    lender.release("r4")


def test_mooncake_is_refused_with_a_secret(tmp_path):
    with pytest.raises(InputError, match="neither encrypted nor authenticated"):
        check_connector("mooncake", tmp_path / "secret")
    with pytest.raises(InputError, match="--kv-connector='nccl' must be one of zmq, mooncake"):
        check_connector("nccl", None)


def test_a_server_with_the_mooncake_connector_answers_as_transformers(tiny_bpe, tmp_path):
    import httpx
    import openai
    import transformers

    from moeinfra.engine.tokenizer import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_bpe), dtype=torch.float32)
    tok = Tokenizer(tiny_bpe)
    server = disaggregated(tiny_bpe, tmp_path / "kv", "--kv-connector", "mooncake")
    try:
        units = httpx.get(f"{server.url}/health", timeout=10).json()["units"].values()
        assert sorted(u["kv_connector"] for u in units) == ["mooncake", "mooncake"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )[0, len(ids):].tolist()  # fmt: skip
            reply = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=ids,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert reply.choices[0].model_extra["token_ids"] == ref, prompt
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_a_decode_unit_on_another_connector_fails_the_request_naming_the_option(tiny_bpe):
    """A prefill unit lending its blocks to Mooncake and a decode unit on ZeroMQ: the request
    fails at once with the reason, nothing waits for the hand-off's timeout."""
    import os
    import re
    import subprocess
    import sys

    import httpx

    from .conftest import ServerProcess, wait_until

    srv = ServerProcess(["--model", str(tiny_bpe), "--prefill-units", "0", "--decode-units", "0"])
    control = re.search(r"control (tcp://\S+?)\)", "".join(srv.log)).group(1)  # it bound port 0
    units = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moeinfra.cli",
                "serve",
                "unit",
                "--server",
                control,
                "--model",
                str(tiny_bpe),
                "--role",
                role,
                "--ranks",
                "1",
                "--unit-id",
                role,
                "--kv-connector",
                connector,
                "--block-size",
                "16",
                "--num-kv-blocks",
                "256",
            ],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
        for role, connector in (("prefill", "mooncake"), ("decode", "zmq"))
    ]
    try:
        wait_until(
            lambda: httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, timeout_s=120
        )
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8}
        answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code >= 500
        assert "read through Mooncake" in answer.text and "--kv-connector zmq" in answer.text
    finally:
        assert srv.stop() == 0, "".join(srv.log)
        for unit in units:
            if unit.poll() is None:
                unit.kill()
            unit.wait(30)
