"""Every widget of a notebook moved to the ends of each of its controls, in the notebook's kernel.

nbval runs a notebook's cells, so each widget's callback runs once, at its controls' starting
values; a student then drags a slider to its end, picks the last model in a list or empties a
text box. This module is the source of one more cell that conftest.py appends to every
notebook nbval collects, after the last one: it runs in the same kernel, finds the live
widgets built by `interact` / `interactive` and `interactive_output`, and calls each widget's
function once per control value below, the other controls at their starting values, then with
every control at its first value and with every control at its last:

- a slider: its minimum and its maximum (for a log slider, base**min and base**max);
- a dropdown, a selection slider, radio buttons: every option;
- a checkbox: both values;
- a text box: the empty string (a student clears it) and the starting text;
- an integer box: 0, -1 and 2**31.

A widget shows an exception its function raises as a traceback under the controls, which a
student reads as the course being broken: a value the function cannot draw must be answered
with a printed sentence instead. So any exception fails the cell, naming the widget's function,
the control and the value; the callbacks' own output (figures, printed text) is captured and
dropped.
"""

from __future__ import annotations


def probe_values(control):
    """The values a student can reach with `control` that the probe tries."""
    import ipywidgets as widgets

    if isinstance(control, widgets.FloatLogSlider):
        return [control.base ** control.min, control.base ** control.max]
    if isinstance(control, (widgets.IntSlider, widgets.FloatSlider, widgets.IntRangeSlider,
                            widgets.FloatRangeSlider, widgets.BoundedIntText,
                            widgets.BoundedFloatText)):
        if isinstance(control.value, tuple):
            return [(control.min, control.min), (control.max, control.max)]
        return [control.min, control.max]
    if isinstance(control, widgets.widget_selection._Selection):
        return list(control._options_values)
    if isinstance(control, widgets.Checkbox):
        return [False, True]
    if isinstance(control, (widgets.Text, widgets.Textarea, widgets.Combobox)):
        return ["", control.value]
    if isinstance(control, widgets.IntText):
        return [0, -1, 2 ** 31]
    if isinstance(control, widgets.FloatText):
        return [0.0, -1.0]
    return [control.value]


def live_callbacks():
    """(function, {argument name: control}) of every live interact / interactive_output."""
    import inspect

    import ipywidgets as widgets
    from ipywidgets.widgets.widget import _instances

    found, seen = [], set()
    for widget in list(_instances.values()):
        if isinstance(widget, widgets.interactive):
            if id(widget) not in seen:
                seen.add(id(widget))
                found.append((widget.f, {c._kwarg: c for c in widget.kwargs_widgets}))
            continue
        notifiers = getattr(widget, "_trait_notifiers", {}).get("value", {}).get("change", [])
        for observer in notifiers:
            if getattr(observer, "__qualname__", "").startswith("interactive_output.") \
                    and id(observer) not in seen:
                seen.add(id(observer))
                closure = inspect.getclosurevars(observer).nonlocals
                found.append((closure["f"], dict(closure["controls"])))
    return found


def probe_widgets(expected: int = 0) -> int:
    """Call every live widget's function at each probe value; raise listing what failed, or
    when fewer than `expected` widgets are alive (the notebook builds that many). Returns the
    number of calls made."""
    import matplotlib.pyplot as plt
    from IPython.utils.capture import capture_output

    callbacks = live_callbacks()
    assert len(callbacks) >= expected, (
        f"the notebook builds {expected} widget(s) with a function behind them, "
        f"{len(callbacks)} are alive (run in reading mode: TINYGPT_GRADING unset or 0)")
    failures, calls = [], 0
    for function, controls in callbacks:
        start = {name: control.value for name, control in controls.items()}
        values = {name: probe_values(control) for name, control in controls.items()}
        trials = [(f"{name}={value!r}", dict(start, **{name: value}))
                  for name, tried in values.items() for value in tried]
        # and every control at its first probe value, then at its last, together
        for end in (0, -1):
            together = {name: tried[end] for name, tried in values.items()}
            trials.append((", ".join(f"{n}={v!r}" for n, v in together.items()), together))
        for what, kwargs in trials:
            calls += 1
            try:
                with capture_output(display=True):
                    function(**kwargs)
            except Exception as err:  # noqa: BLE001 - every kind is a failure
                failures.append(f"{function.__name__}({what}): {type(err).__name__}: {err}")
            finally:
                plt.close("all")
    assert not failures, "widgets that fail when a control is moved:\n" + "\n".join(failures)
    print(f"{len(callbacks)} widget(s), {calls} calls, all answered")
    return calls
