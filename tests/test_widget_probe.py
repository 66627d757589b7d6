"""The widget probe (tests/widget_probe.py, run by nbval after every notebook) finds a widget
whose function fails at the end of a control, and passes one that answers every value."""

from __future__ import annotations

import ipywidgets as widgets
import pytest

from tests.widget_probe import live_callbacks, probe_values, probe_widgets


@pytest.fixture
def no_live_widgets():
    """Close the widgets a test builds so that the next test's probe does not see them."""
    yield
    widgets.Widget.close_all()


def test_a_slider_and_a_dropdown_are_tried_at_their_ends_and_every_option():
    assert probe_values(widgets.IntSlider(value=3, min=1, max=9)) == [1, 9]
    assert probe_values(widgets.FloatLogSlider(value=10, base=10, min=0, max=3)) == [1, 1000]
    assert probe_values(widgets.Dropdown(options=[("bf16", 2), ("fp8", 1)])) == [2, 1]
    assert probe_values(widgets.SelectionSlider(options=["a", "b", "c"])) == ["a", "b", "c"]
    assert probe_values(widgets.Text(value="hi")) == ["", "hi"]
    assert probe_values(widgets.Checkbox(value=True)) == [False, True]


def test_a_function_that_fails_at_a_sliders_end_is_named(no_live_widgets):
    def histogram(bins, label):
        if bins == 10:
            raise ZeroDivisionError("division by zero")
        print(label * bins)

    widgets.interactive(histogram, bins=widgets.IntSlider(value=3, min=1, max=10),
                        label=widgets.Text(value="x"))
    with pytest.raises(AssertionError, match=r"histogram\(bins=10\): ZeroDivisionError"):
        probe_widgets(expected=1)


def test_interactive_output_is_found_and_the_ends_together_are_tried(no_live_widgets):
    def ratio(top, bottom):
        if top == 5 and bottom == 0:  # only when both sit at an end together
            raise ValueError("0 bottom")

    controls = {"top": widgets.IntSlider(value=2, min=0, max=5),
                "bottom": widgets.IntSlider(value=2, min=0, max=5)}
    widgets.interactive_output(ratio, controls)
    assert [f.__name__ for f, _ in live_callbacks()] == ["ratio"]
    assert probe_widgets(expected=1) == 6  # 2 + 2 ends, then both at their first, both at last

    def last_first(top, bottom):
        if top == 5 and bottom == 5:
            raise ValueError("both at the end")

    widgets.interactive_output(last_first, {"top": widgets.IntSlider(value=2, min=0, max=5),
                                            "bottom": widgets.IntSlider(value=2, min=0, max=5)})
    with pytest.raises(AssertionError, match=r"last_first\(top=5, bottom=5\): ValueError"):
        probe_widgets(expected=2)


def test_a_widget_that_answers_with_a_sentence_passes_and_missing_widgets_fail(no_live_widgets):
    with pytest.raises(AssertionError, match="builds 1 widget"):
        probe_widgets(expected=1)

    def seed_box(seed):
        if seed < 0:
            print("the seed must be 0 or more")
            return
        print(seed)

    widgets.interactive(seed_box, seed=widgets.IntText(value=0))
    assert probe_widgets(expected=1) == 3 + 2
