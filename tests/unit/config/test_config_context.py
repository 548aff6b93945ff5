"""The helpers the configuration checks share: divisors, complete for realistic values and bounded in work for
any value (a fuzzed batch of 2^62 once made a check count to it)."""

from __future__ import annotations

import pytest

from libra.config.context import DIVISOR_SEARCH, common_divisors, divisors, one_of


@pytest.mark.parametrize("n, limit, expected", [
    pytest.param(12, None, [1, 2, 3, 4, 6, 12], id="twelve"),
    pytest.param(36, None, [1, 2, 3, 4, 6, 9, 12, 18, 36], id="a-square-counts-its-root-once"),
    pytest.param(1, None, [1], id="one"),
    pytest.param(13, None, [1, 13], id="prime"),
    pytest.param(12, 4, [1, 2, 3, 4], id="up-to-a-limit"),
    pytest.param(0, None, [], id="zero"),
    pytest.param(-6, None, [], id="negative"),
    # beyond 2^32: the divisors up to 2^16 and their cofactors, found without counting to n
    pytest.param(2**62, None, [2**k for k in range(17)] + [2**k for k in range(46, 63)], id="far-beyond-any-cluster"),
    pytest.param(2**61 - 1, None, [1, 2**61 - 1], id="a-huge-prime"),
])
def test_divisors(n: int, limit: int | None, expected: list[int]) -> None:
    assert divisors(n, limit) == expected


def test_divisors_are_complete_up_to_the_search_squared() -> None:
    n = 2**16 * 3**10  # below 2^32, with divisors on both sides of 2^16
    assert n < DIVISOR_SEARCH**2
    assert divisors(n) == sorted(2**a * 3**b for a in range(17) for b in range(11))


def test_common_divisors_and_the_choice_text() -> None:
    assert common_divisors(12, 18, 30) == [1, 2, 3, 6]
    assert one_of(common_divisors(8, 12, limit=2)) == "{1, 2}"
