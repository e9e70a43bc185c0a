"""Prefix affinity: a prefix's requests keep to one replica, under bounded load; a replica leaving
moves only its keys; unhealthy and saturated replicas are passed over; end to end through the
gateway in front of two replicas."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gateway.backends.affinity import AffinityRing, prefix_key
from gateway.backends.health import Replica
from gateway.config.policy import HealthSettings
from gateway.pipeline import prefix_keys
from gateway.pipeline.prefix_keys import PrefixKeys
from tests.engine.server_proc import ManagedServer
from tests.gateway.processes import create_key_cli, start_gateway

URLS = [f"http://10.0.0.{i}:8001" for i in range(1, 5)]
SYSTEM = "You are a support agent for ACME. " * 40


def _replicas(urls: list[str] = URLS) -> list[Replica]:
    return [Replica(u, HealthSettings(max_queue_depth=4)) for u in urls]


def _chat(system: str, question: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_the_key_is_the_leading_messages_or_a_lone_prompts_first_blocks() -> None:
    assert prefix_key(_chat(SYSTEM, "where is my order?")) == prefix_key(_chat(SYSTEM, "refund please"))
    assert prefix_key(_chat(SYSTEM, "q")) != prefix_key(_chat(SYSTEM + " Be brief.", "q"))
    shared = "x" * 640  # 10 blocks of 64 characters
    assert prefix_key({"prompt": shared + "first question"}) == prefix_key({"prompt": shared + "other"})
    assert prefix_key({"messages": [{"role": "user", "content": shared + "a"}]}) == prefix_key(
        {"messages": [{"role": "user", "content": shared + "bb"}]}
    )
    assert prefix_key({"prompt": "y" + shared}) != prefix_key({"prompt": shared})
    # a lone prompt's key covers its first 256 tokens' worth (1,024 characters): what comes after
    # (the question after shared instructions or a shared document) does not matter
    document = "z" * 1024
    assert prefix_key({"prompt": document + "A" * 500}) == prefix_key({"prompt": [document + "B"]})
    assert prefix_key({"prompt": "short"}) is None and prefix_key({"messages": []}) is None
    ids = list(range(100))
    assert prefix_key({"prompt": ids + [7]}) == prefix_key({"prompt": ids + [8, 9]})  # 96 = 6 whole blocks
    batched = prefix_key({"prompt": [ids, [1]]})
    assert batched == prefix_key({"prompt": [ids]}) != prefix_key({"prompt": [5] * 32})
    assert prefix_key({"prompt": [3] * 10}) is None and prefix_key({"prompt": [{"x": 1}]}) is None
    assert prefix_key({"prompt": [2**64 - 1] * 16}) is not None  # the largest id a body can hold
    assert prefix_key({"prompt": [1.5] * 16}) is None


_WORDS = [f"w{i}" for i in range(50)]


def _word_tokenizer(path: Path) -> str:
    """A tokenizer.json with one token per word of _WORDS (and per word of the other test texts)."""
    vocab = {w: i for i, w in enumerate(["[UNK]", *_WORDS, "question", "one", "two"])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def test_with_the_pools_tokenizer_a_lone_prompts_key_is_its_first_256_tokens(tmp_path: Path) -> None:
    keys, tokenizer = PrefixKeys(), _word_tokenizer(tmp_path)

    def key(text: str, tok: str | None = tokenizer) -> int | None:
        return asyncio.run(keys.key({"messages": [{"role": "user", "content": text}]}, tok))

    head = _words(1, 256)  # 256 tokens of ~2.9 characters: ~740 characters, under 1,024
    one, two = head + " question one " + _words(2, 100), head + " question two " + _words(3, 100)
    assert key(one) == key(two) is not None  # counted in tokens: the same first 256
    assert key(one, None) != key(two, None)  # in characters, 1,024 of them reach the questions
    assert key(_words(1, 250) + " one " + _words(4, 30)) != key(one)  # a difference at token 250
    assert key(_words(5, 15)) is None  # under one block of 16 tokens: nothing to share
    assert key(_words(5, 16)) == key(_words(5, 16) + " question") is not None
    # a key the other way than a lone prompt is the same with or without a tokenizer
    chat = _chat(SYSTEM, "q")
    assert asyncio.run(keys.key(chat, tokenizer)) == prefix_key(chat)


def test_a_prefix_is_tokenized_once_off_the_event_loop_and_an_unreadable_tokenizer_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, tokenizer = PrefixKeys(size=2), _word_tokenizer(tmp_path)
    calls: list[str] = []
    real = prefix_keys.token_key

    def counted(text: str, tok: str) -> int | None:
        calls.append(threading.current_thread().name)
        return real(text, tok)

    monkeypatch.setattr(prefix_keys, "token_key", counted)
    prompts = [{"prompt": _words(seed, 300)} for seed in (1, 1, 1, 2, 3, 1)]

    async def run() -> list[int | None]:
        return [await keys.key(p, tokenizer) for p in prompts]

    found = asyncio.run(run())
    assert found[0] == found[1] == found[2] == found[5] and len(set(found)) == 3
    assert len(calls) == 4  # seed 1 once, 2, 3, then 1 again: the map holds the 2 most recent
    assert threading.main_thread().name not in calls
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    broken = PrefixKeys()
    prefix_keys.hf_tokenizer.cache_clear()
    text = {"prompt": _words(1, 300)}
    assert asyncio.run(broken.key(text, str(tmp_path))) == prefix_key(text)  # characters, no error
    prefix_keys.hf_tokenizer.cache_clear()


def test_requests_sharing_a_prefix_go_to_one_replica() -> None:
    ring, replicas = AffinityRing(URLS), _replicas()
    key = prefix_key(_chat(SYSTEM, "q"))
    assert key is not None
    chosen = {ring.choose(key, replicas, frozenset(), 1.25)[0].url for _ in range(20)}  # type: ignore[union-attr]
    assert len(chosen) == 1
    homes = {ring.order(random.Random(i).getrandbits(64))[0] for i in range(400)}
    assert homes == set(URLS)  # and different prefixes spread over every replica


def test_load_stays_bounded_when_one_prefix_is_hot() -> None:
    ring, replicas = AffinityRing(URLS), _replicas()
    key = random.Random(1).getrandbits(64)
    hits = 0
    for _ in range(200):  # one hot prefix, nothing finishes: its home fills to the bound, then spills
        replica, home = ring.choose(key, replicas, frozenset(), 1.25)
        assert replica is not None
        replica.in_flight += 1
        hits += home
        assert max(r.in_flight for r in replicas) <= -(-1.25 * sum(r.in_flight for r in replicas) // 4) + 1
    assert 40 < hits < 200 and min(r.in_flight for r in replicas) > 0


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    four, three = AffinityRing(URLS), AffinityRing(URLS[:3])
    keys = [random.Random(i).getrandbits(64) for i in range(1000)]
    moved = [k for k in keys if four.order(k)[0] != three.order(k)[0]]
    assert moved and all(four.order(k)[0] == URLS[3] for k in moved)


def test_unhealthy_saturated_and_avoided_replicas_are_passed_over() -> None:
    ring, replicas = AffinityRing(URLS), _replicas()
    key = random.Random(2).getrandbits(64)
    order = ring.order(key)
    by_url = {r.url: r for r in replicas}
    by_url[order[0]].check_ok = False  # failed its health check
    by_url[order[1]].queue_depth = 10  # over max_queue_depth
    chosen, home = ring.choose(key, replicas, frozenset({order[2]}), 1.25)
    assert chosen is not None and chosen.url == order[3] and not home


def test_through_the_gateway_a_prefixs_requests_keep_to_one_replica(tmp_path: Path) -> None:
    fakes = [ManagedServer(lambda port: [sys.executable, "tests/fakes/fast_upstream.py", "--port", str(port)])
             for _ in range(2)]  # fmt: skip
    gateway = None
    try:
        urls = ", ".join(f'"{f.base_url}"' for f in fakes)
        policy = tmp_path / "policy.yaml"
        tokenizer = _word_tokenizer(tmp_path)
        policy.write_text(f"backends:\n  pool: {{type: engine, urls: [{urls}], balance: prefix_affinity,"
                          f" tokenizer: '{tokenizer}'}}\nmodels:\n  fast: {{backend: pool}}\n")  # fmt: skip
        env = {"GATEWAY_MASTER_KEY": "m", "GATEWAY_KEY_SECRET": "s",
               "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"}  # fmt: skip
        gateway = start_gateway(policy, env)
        headers = {"authorization": f"Bearer {create_key_cli(env, 'affinity')}"}
        served = lambda: [httpx.get(f"{f.base_url}/stats").json()["requests"] for f in fakes]  # noqa: E731
        used = set()
        for group in range(12):
            before = served()
            for user in range(4):
                body = {"model": "fast", **_chat(f"System prompt number {group}. " * 30, f"question {user}")}
                r = httpx.post(
                    f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
                )
                assert r.status_code == 200
            grew = [after - b for after, b in zip(served(), before, strict=True)]
            assert sorted(grew) == [0, 4]  # the group's four requests on one replica
            used.add(grew.index(4))
        assert used == {0, 1}  # and the groups over both
        for group in range(6):  # lone prompts: the same first 256 tokens (the pool's tokenizer), then not
            before = served()
            for user in range(3):
                text = f"{_words(100 + group, 256)} question {_words(user, 40)}"
                body = {"model": "fast", "messages": [{"role": "user", "content": text}]}
                r = httpx.post(
                    f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
                )
                assert r.status_code == 200
            assert sorted(after - b for after, b in zip(served(), before, strict=True)) == [0, 3]
        metrics = httpx.get(f"{gateway.base_url}/metrics", headers={"authorization": "Bearer m"}).text
        assert 'gateway_affinity_requests_total{backend="pool",outcome="hit"} 66.0' in metrics
    finally:
        if gateway is not None:
            gateway.stop()
        for fake in fakes:
            fake.stop()
