"""The test file a library author would write for layer.py (named check_*.py so that the gradaudit
project's own test run does not collect it: the second test fails on purpose).

    pytest examples/no_waste/check_layer.py

The ``no_waste`` fixture comes from gradaudit's pytest plugin (active once gradaudit is installed);
outside pytest, call ``gradaudit.assert_no_waste`` directly - it raises AssertionError the same way.
"""

import torch

import gradaudit
from layer import FeedForward, SquaredReLU, SquaredReLUSavingInput


def test_feed_forward_holds_only_what_backward_reads(no_waste):
    # verify=True: custom Functions are checked by running their backward on poisoned values
    no_waste(FeedForward(activation=SquaredReLU), torch.randn(16, 64), verify=True)


def test_plain_assertion_works_in_any_runner():
    # A frozen feed-forward with a differentiable input: Linear saves only what it needs.
    model = FeedForward(activation=SquaredReLU).requires_grad_(False)
    gradaudit.assert_no_waste(model, torch.randn(16, 64, requires_grad=True), verify=True)


def test_regressed_layer_is_caught(no_waste):
    # Fails on purpose: this is what the regression in SquaredReLUSavingInput looks like in CI.
    no_waste(FeedForward(activation=SquaredReLUSavingInput), torch.randn(16, 64), verify=True)
