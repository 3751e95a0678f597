"""The leader's answers replayed where huggingface_hub is 0.x (its client is ``requests``; the
tf4 line, transformers 4.57): followers take the library's online path with no request.

The differential test's replay scenarios that transformers 4.57 reaches, in one job of three
ranks run plain and patched and compared per rank (``tests/differential.py``): the tokenizer
whose online and offline loads differ (transformers' Mistral-regex check asks ``model_info``
online; offline it reads ``config.json``, warns, and with ``fix_mistral_regex=True`` gives other
ids), the same with the leader's ``model_info`` answered 404, a remote-code model (its
``model_info`` after the weights), a sentence-transformers model saved byte for byte (its model
card asks ``model_info`` online), and user code's own metadata calls (rank 0 asks, the others
get its answers); and a model whose non-persistent buffer its ``_init_weights`` draws from each
rank's own random stream (4.57 initialises it inside the loading step a follower replaces). On
huggingface_hub >= 1 the same scenarios run in ``test_differential.py``.
"""

from __future__ import annotations

from typing import Any

import huggingface_hub
import pytest

import test_differential as td
from differential import Group, Harness, Requests, Scenario, SetupContext, scenario_diff
from patchload.testing import LoopbackHub

pytestmark = [
    pytest.mark.tf4,
    pytest.mark.skipif(not huggingface_hub.__version__.startswith("0."),
                       reason=f"huggingface_hub {huggingface_hub.__version__} is not 0.x: "
                              "test_differential.py's replay group runs these scenarios"),
]


def _setup(ctx: SetupContext) -> None:
    td._mistral_setup(ctx)
    td._remote_setup(ctx)
    td._llama(ctx, "rp/api", seed=46, with_tokenizer=False)
    td._sentence_setup(ctx)
    td._toy_random_setup(ctx)


HUB0_REPLAY = Scenario(
    "hub0-replay", (*td.MISTRAL.steps, td.REMOTE_CODE.steps[0], *td.SENTENCE.steps,
                    *td.HUB_API.steps, *td.TOY_RANDOM_STEPS),
    Requests.ONE_PER_CACHE, setup=_setup, per_run=td._mistral_run)
GROUP = Group("hub0-replay", (HUB0_REPLAY,), nproc=3)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("differential-hub0")
    with LoopbackHub(log_path=root / "hub-requests.jsonl") as hub:
        yield Harness(hub, root, (GROUP,))


@pytest.mark.timeout(td.TEST_TIMEOUT_S)
def test_followers_get_the_leaders_answers_through_requests(harness: Harness) -> None:
    """Per rank and step: the same tokens, warnings, weights and answers as plain; followers
    make no request (the scenario's rule), so their calls went the online way."""
    plain, patched = harness.side(GROUP.name, "plain"), harness.side(GROUP.name, "shm")
    diffs = scenario_diff(plain, patched, GROUP, HUB0_REPLAY)
    assert diffs == [], "hub0-replay differs from plain:\n" + "\n".join(diffs)
    # The Mistral check went online on every rank: no "incorrect regex pattern" warning.
    fix = patched.ranks[1]["steps"]["hub0-replay/fix"]["attempts"][0]
    assert fix["ok"] and not any("regex" in w for w in fix["obs"].get("warnings", [])), fix
