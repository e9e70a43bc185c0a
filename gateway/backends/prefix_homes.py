"""Where each prefix lives: consistent hashing with bounded load, on prefixes and on requests.

The ring (`gateway.backends.affinity`) orders the replicas for a prefix key. With few distinct
prefixes, hashing alone splits them unevenly (8 system prompts over 2 replicas land 4/4 only 27%
of the time, 6/2 or worse 29%), and spilling single requests off a busy home to even the load
makes every replica compute every busy prefix, which is what affinity is for avoiding. So the
bound applies twice, as in Mirrokni et al.'s model, where the balls are the keys:

- a prefix seen for the first time is placed on the first replica in its ring order that holds
  less than an even share of the placed prefixes, this one counted (and could take the request):
  a prefix brings all its requests, so prefixes are spread evenly, not within a factor (with 8
  prompts on 2 replicas, 1.25 x the mean would allow 5/3); it keeps that home while it is used
  (LRU, at most MAX_PREFIXES, forgotten after IDLE_S unused);
- a request goes to its prefix's home unless the home is down, saturated, already failed this
  request, or past the request bound (`load_factor` x the mean requests in flight, or the mean
  plus `slack`, whichever is more): then it spills to the next replica in ring order, and the
  prefix keeps its home; a home that is down or gone is replaced.

Each gateway process keeps its own placements: processes that see new prefixes in different
orders may place a few differently (their ring order agrees), at the cost of one more prefill.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from gateway.backends.affinity import AffinityRing
from gateway.backends.health import Replica

MAX_PREFIXES = 4096  # placements remembered per pool (a flood of one-off prefixes churns them)
IDLE_S = 600.0  # a prefix unused this long is forgotten (its KV is likely evicted by then)


class PrefixHomes:
    """A pool's ring and the home of each prefix it has seen lately."""

    def __init__(
        self,
        urls: Sequence[str],
        size: int = MAX_PREFIXES,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ring = AffinityRing(urls)
        self._urls = frozenset(urls)
        self._size = size
        self._idle_s = idle_s
        self._clock = clock
        self._homes: OrderedDict[int, tuple[str, float]] = OrderedDict()  # key -> (url, last used)
        self._placed: Counter[str] = Counter()  # prefixes per replica

    def placed(self) -> dict[str, int]:
        """Prefixes placed on each replica (replicas with none omitted)."""
        self._expire(self._clock())
        return {url: n for url, n in self._placed.items() if n}

    def adopt(self, previous: PrefixHomes) -> None:
        """Take over the placements of the pool this one replaces: a replica that left gives up its
        own prefixes, one that joined takes the prefixes whose ring home it now is (its share, as
        plain consistent hashing would move), every other prefix stays where its KV is."""
        joined = self._urls - previous._urls
        for key, url, used in previous.homes():
            if url in self._urls and not (joined and self.ring.order(key)[0] in joined):
                self._set(key, url, used)

    def homes(self) -> list[tuple[int, str, float]]:
        """(key, home, last used) of every placement, least recently used first."""
        self._expire(self._clock())
        return [(key, url, used) for key, (url, used) in self._homes.items()]

    def choose(
        self, key: int, replicas: Sequence[Replica], avoid: frozenset[str], load_factor: float, slack: int = 0
    ) -> tuple[Replica | None, bool]:
        """(the replica for `key`, whether it is the prefix's home); None: none within bounds."""
        usable = [r for r in replicas if r.usable()]
        if not usable:
            return None, False
        by_url = {r.url: r for r in replicas}
        mean = (sum(r.in_flight for r in usable) + 1) / len(usable)  # this request counted
        cap = max(math.ceil(load_factor * mean), math.ceil(mean) + slack)

        def fits(replica: Replica | None) -> bool:
            return (
                replica is not None
                and replica.url not in avoid
                and replica.usable()
                and not replica.saturated()
                and replica.in_flight + 1 <= cap
            )

        now = self._clock()
        self._expire(now)
        home = self._homes.get(key)
        order = self.ring.order(key)
        if home is not None and home[0] in by_url and by_url[home[0]].usable():
            self._set(key, home[0], now)
            if fits(by_url[home[0]]):
                return by_url[home[0]], True
            return next((by_url[u] for u in order if u != home[0] and fits(by_url.get(u))), None), False
        room = math.ceil((sum(self._placed[r.url] for r in usable) + 1) / len(usable))  # an even share
        candidates = [by_url[u] for u in order if fits(by_url.get(u))]
        chosen = next((r for r in candidates if self._placed[r.url] < room), None)
        chosen = chosen or (candidates[0] if candidates else None)
        if chosen is not None:
            self._set(key, chosen.url, now)
        return chosen, chosen is not None and home is None  # a new home; a lost one's move is a spill

    def _set(self, key: int, url: str, used: float) -> None:
        old = self._homes.pop(key, None)
        if old is not None:
            self._placed[old[0]] -= 1
        self._homes[key] = (url, used)
        self._placed[url] += 1
        while len(self._homes) > self._size:
            self._drop_oldest()

    def _expire(self, now: float) -> None:
        while self._homes and now - next(iter(self._homes.values()))[1] > self._idle_s:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (url, _) = self._homes.popitem(last=False)
        self._placed[url] -= 1
