"""The planner's entry point for ``anelab plan`` (``planner.plan_request``) and the one "what settles it" that plan
and decide share (``planner.settle``): the command prints what the entry point returns, and the settle lines
are the ones plan and decide printed before they shared them (written out here by hand)."""

from __future__ import annotations

import json

from anelab.cli import main
from anelab.decide.decision import DecideConfig, what_settles_it
from anelab.planner.plan_request import PlanOptions, plan_request

FAMILY, PROMPT = "qwen3.5-2b-4bit", 4333  # a recorded family whose verdict at this prompt depends (settle lines)


def _printed(argv: list[str], capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_plan_prints_what_the_planner_entry_point_returns(capsys):
    result = plan_request(PlanOptions(prompt_tokens=PROMPT, family=FAMILY))
    argv = ["plan", "--family", FAMILY, "--prompt-tokens", str(PROMPT)]
    assert json.loads(_printed([*argv, "--json"], capsys)) == json.loads(json.dumps(result.payload, default=str))
    assert _printed(argv, capsys) == result.text() + "\n"
    # negative control: another prompt is another plan
    other = plan_request(PlanOptions(prompt_tokens=2 * PROMPT, family=FAMILY))
    assert other.payload["prompt_tokens"] != result.payload["prompt_tokens"] and other.text() != result.text()


def test_plan_settles_a_depending_verdict_with_plan_and_decide_commands():
    [verdict] = plan_request(PlanOptions(prompt_tokens=PROMPT, family=FAMILY)).payload["verdicts"]
    assert verdict["decision"] == "depends"
    assert [tuple(s) for s in verdict["settle"]] == [
        (
            "time your GPU runtime's prefill of a 4,333-token prompt (seconds, S)",
            "anelab plan --family qwen3.5-2b-4bit --prompt-tokens 4333 --gpu-prefill-seconds S",
        ),
        (
            "time your model's own loads and ANE predictions on a Mac",
            "anelab decide CHECKPOINT --prompt-tokens 4333 --measure",
        ),
    ]


def test_decide_settles_with_its_own_command():
    config = DecideConfig(checkpoint="ck", prompt_tokens=2048, out="report", chunk=256, design="stateful")
    mac = (
        "time this model's own loads and ANE predictions on a Mac (Core ML, cold and warm)",
        "anelab decide ck --prompt-tokens 2048 --out report --chunk 256 --design stateful --measure",
    )
    assert what_settles_it(config) == {
        "gpu_prefill": (
            "time your GPU runtime's prefill of a 2,048-token prompt (seconds, S)",
            "anelab decide ck --prompt-tokens 2048 --out report --chunk 256 --design stateful --gpu-prefill-seconds S",
        ),
        "load_per_layer": mac,
        "ane_attention": mac,
    }
    # negative control: the automatic design is not spelled out, a family is
    auto = what_settles_it(DecideConfig(checkpoint="ck", prompt_tokens=2048, out="report", family="f"))
    assert auto["ane_attention"][1] == "anelab decide ck --prompt-tokens 2048 --out report --family f --measure"
