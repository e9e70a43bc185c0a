"""Prefix affinity: a prefix's requests keep to one replica, under bounded load; a replica leaving
moves only its keys; unhealthy and saturated replicas are passed over; end to end through the
gateway in front of two replicas."""

from __future__ import annotations

import asyncio
import random
import re
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gateway.backends.affinity import AffinityRing, prefix_key
from gateway.backends.base import Upstream
from gateway.backends.engine import EnginePool
from gateway.backends.health import Replica
from gateway.backends.prefix_homes import PrefixHomes
from gateway.config.policy import EngineBackend, HealthSettings, Policy, parse_policy
from gateway.pipeline import prefix_keys
from gateway.pipeline.prefix_keys import PrefixKeys
from gateway.pipeline.runtime import build_runtime
from gateway.routing.complexity import ComplexityModel
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
    homes_, replicas = PrefixHomes(URLS), _replicas()
    key = prefix_key(_chat(SYSTEM, "q"))
    assert key is not None
    chosen = {homes_.choose(key, replicas, frozenset(), 1.25)[0].url for _ in range(20)}  # type: ignore[union-attr]
    assert chosen == {homes_.ring.order(key)[0]}
    homes = {homes_.ring.order(random.Random(i).getrandbits(64))[0] for i in range(400)}
    assert homes == set(URLS)  # and different prefixes spread over every replica


def test_load_stays_bounded_when_one_prefix_is_hot() -> None:
    ring, replicas = PrefixHomes(URLS), _replicas()
    key = random.Random(1).getrandbits(64)
    hits = 0
    for _ in range(200):  # one hot prefix, nothing finishes: its home fills to the bound, then spills
        replica, home = ring.choose(key, replicas, frozenset(), 1.25)
        assert replica is not None
        replica.in_flight += 1
        hits += home
        assert max(r.in_flight for r in replicas) <= -(-1.25 * sum(r.in_flight for r in replicas) // 4) + 1
    assert 40 < hits < 200 and min(r.in_flight for r in replicas) > 0


def test_slack_keeps_a_prefix_home_under_light_load_and_the_factor_bounds_heavy_load() -> None:
    ring, replicas = PrefixHomes(URLS[:2]), _replicas(URLS[:2])
    key = random.Random(3).getrandbits(64)
    home_url = ring.ring.order(key)[0]
    for in_flight in range(6):  # 2 replicas: a factor of 1.25 alone would spill the 4th request
        replica, home = ring.choose(key, replicas, frozenset(), 1.25, slack=4)
        assert replica is not None and replica.url == home_url and home, in_flight
        replica.in_flight += 1
    strict, _ = ring.choose(key, replicas, frozenset(), 1.25)  # no slack: ceil(1.25 x 3.5) = 5 < 7
    assert strict is not None and strict.url != home_url
    hits = 0
    for _ in range(400):  # one hot prefix, nothing finishes: the factor takes over from the slack
        replica, home = ring.choose(key, replicas, frozenset(), 1.25, slack=4)
        assert replica is not None
        replica.in_flight += 1
        hits += home
        mean = sum(r.in_flight for r in replicas) / 2
        assert max(r.in_flight for r in replicas) <= max(-(-1.25 * mean // 1), -(-mean // 1) + 4) + 1
    assert 0 < 400 - hits < 200  # some spilled, most stayed home


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_few_prefixes_are_placed_evenly_and_keep_their_homes(factor: float) -> None:
    worst = 0
    for trial in range(50):  # hashing alone splits 8 prefixes 6/2 or worse about 29% of the time
        homes, replicas = PrefixHomes(URLS[:2]), _replicas(URLS[:2])
        rng = random.Random(trial)
        keys = [rng.getrandbits(64) for _ in range(8)]
        first = {k: homes.choose(k, replicas, frozenset(), factor)[0].url for k in keys}  # type: ignore[union-attr]
        worst = max(worst, *Counter(first.values()).values())
        for _ in range(3):  # later requests go home, whichever replica is less loaded
            replicas[0].in_flight, replicas[1].in_flight = rng.randrange(3), rng.randrange(3)
            assert all(homes.choose(k, replicas, frozenset(), factor, 4) == (
                next(r for r in replicas if r.url == first[k]), True) for k in keys)  # fmt: skip
        assert sum(homes.placed().values()) == 8
    assert worst == 4  # always 4/4


def test_placements_are_bounded_and_forgotten_when_idle() -> None:
    now = [0.0]
    homes, replicas = PrefixHomes(URLS, size=10, idle_s=60, clock=lambda: now[0]), _replicas()
    for key in range(25):  # a flood of one-off prefixes: the oldest are forgotten
        homes.choose(key, replicas, frozenset(), 1.25)
        now[0] += 1
    assert sum(homes.placed().values()) == 10 and [k for k, _, _ in homes.homes()] == list(range(15, 25))
    now[0] += 30
    homes.choose(15, replicas, frozenset(), 1.25)  # used again: kept past the others
    now[0] += 40
    assert [k for k, _, _ in homes.homes()] == [15] and sum(homes.placed().values()) == 1


def test_a_pool_that_loses_a_replica_keeps_the_other_prefixes_homes() -> None:
    four, replicas = PrefixHomes(URLS), _replicas()
    keys = [random.Random(i).getrandbits(64) for i in range(40)]
    before = {k: four.choose(k, replicas, frozenset(), 1.25)[0].url for k in keys}  # type: ignore[union-attr]
    three = PrefixHomes(URLS[:3])
    three.adopt(four)
    after = {k: three.choose(k, replicas[:3], frozenset(), 1.25)[0].url for k in keys}  # type: ignore[union-attr]
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[3] for k in moved)


def test_a_replica_joining_takes_the_prefixes_whose_ring_home_it_is() -> None:
    three, replicas = PrefixHomes(URLS[:3]), _replicas()
    keys = [random.Random(i).getrandbits(64) for i in range(200)]
    before = {k: three.choose(k, replicas[:3], frozenset(), 1.25)[0].url for k in keys}  # type: ignore[union-attr]
    four = PrefixHomes(URLS)
    four.adopt(three)
    after = {k: four.choose(k, replicas, frozenset(), 1.25)[0].url for k in keys}  # type: ignore[union-attr]
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == URLS[3] for k in moved)  # only onto the new replica ...
    assert {k for k in keys if four.ring.order(k)[0] == URLS[3]} == set(moved)  # ... its ring share
    assert 25 < len(moved) < 75  # about a quarter


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    four, three = AffinityRing(URLS), AffinityRing(URLS[:3])
    keys = [random.Random(i).getrandbits(64) for i in range(1000)]
    moved = [k for k in keys if four.order(k)[0] != three.order(k)[0]]
    assert moved and all(four.order(k)[0] == URLS[3] for k in moved)


def test_unhealthy_saturated_and_avoided_replicas_are_passed_over() -> None:
    homes, replicas = PrefixHomes(URLS), _replicas()
    key = random.Random(2).getrandbits(64)
    order = homes.ring.order(key)
    by_url = {r.url: r for r in replicas}
    assert homes.choose(key, replicas, frozenset(), 1.25) == (by_url[order[0]], True)  # placed
    by_url[order[0]].queue_depth = 10  # saturated (over max_queue_depth): a spill, the home stays
    assert homes.choose(key, replicas, frozenset(), 1.25) == (by_url[order[1]], False)
    by_url[order[0]].queue_depth = 0
    assert homes.choose(key, replicas, frozenset({order[0]}), 1.25) == (by_url[order[1]], False)  # failover
    assert homes.choose(key, replicas, frozenset(), 1.25) == (by_url[order[0]], True)
    by_url[order[0]].check_ok = False  # failed its health check: the prefix moves
    by_url[order[1]].queue_depth = 10  # over max_queue_depth
    chosen, home = homes.choose(key, replicas, frozenset({order[2]}), 1.25)
    assert chosen is not None and chosen.url == order[3] and not home
    by_url[order[0]].check_ok = True  # back: the prefix stays where its KV now is
    assert homes.choose(key, replicas, frozenset(), 1.25) == (by_url[order[3]], True)
    assert homes.placed() == {order[3]: 1}


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
        placed = re.findall(r'gateway_affinity_prefixes\{backend="pool",replica="[^"]+"\} (\d+)', metrics)
        counts = sorted(int(n) for n in placed)  # 12 system prompts and 6 lone prompts' prefixes
        assert counts == [9, 9]  # placed evenly
    finally:
        if gateway is not None:
            gateway.stop()
        for fake in fakes:
            fake.stop()


@pytest.mark.parametrize(("slack", "stays_home"), [(None, True), (0, False)])
def test_a_pool_bounds_its_replicas_by_the_policys_factor_and_slack(
    slack: int | None, stays_home: bool
) -> None:
    extra = {} if slack is None else {"load_slack": slack}  # None: the policy's default (4)
    spec = EngineBackend(type="engine", urls=URLS[:2], balance="prefix_affinity", **extra)
    pool = EnginePool("pool", spec, HealthSettings())
    key = random.Random(4).getrandbits(64)
    home_url = AffinityRing(URLS[:2]).order(key)[0]
    assert pool._pick(frozenset(), key).url == home_url  # type: ignore[union-attr]  # placed, idle pool
    for replica in pool.replicas:
        replica.in_flight = 5 if replica.url == home_url else 2  # 8 with this one: mean 4, factor cap 5
    assert (pool._pick(frozenset(), key).url == home_url) is stays_home  # type: ignore[union-attr]
    assert pool.affinity_counts == ({"hit": 2, "spill": 0} if stays_home else {"hit": 1, "spill": 1})


def test_a_policy_reload_that_removes_a_replica_moves_only_its_prefixes() -> None:
    def policy(urls: list[str]) -> Policy:
        listed = ", ".join(f'"{u}"' for u in urls)
        pool = f"{{type: engine, urls: [{listed}], balance: prefix_affinity}}"
        return parse_policy(f"backends:\n  pool: {pool}\nmodels:\n  chat: {{backend: pool}}\n", "p.yaml")

    def picks(pool: Upstream, keys: list[int]) -> dict[int, str]:
        assert isinstance(pool, EnginePool)
        for replica in pool.replicas:
            replica.check_ok = True
        return {k: pool._pick(frozenset(), k).url for k in keys}  # type: ignore[union-attr]

    async def scenario() -> tuple[dict[int, str], dict[int, str]]:
        model = ComplexityModel.load()
        keys = [random.Random(i).getrandbits(64) for i in range(40)]
        first = await build_runtime(policy(URLS), "1", model)
        try:
            before = picks(first.pools["pool"], keys)
            second = await build_runtime(policy(URLS[:3]), "2", model, first)
            try:
                assert second.pools["pool"] is not first.pools["pool"]
                return before, picks(second.pools["pool"], keys)
            finally:
                await second.pools["pool"].close()
        finally:
            await first.pools["pool"].close()

    before, after = asyncio.run(scenario())
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == URLS[3] for k in moved)
