"""The graph of a workflow's steps, drawn on the server as inline SVG: laid
out by ``lay_out`` and drawn by ``draw``, pure functions (steps and edges
in, markup out), as ``charts`` draws the overview's charts.

A step's layer is the longest path to it from the steps that follow none;
each layer is a column, left to right, an arrow from each step to the
steps that run after it. A big workflow stays quick and readable: at most
MAX_LAYERS columns (from just before the first layer with a step in the
queue or the dead letters: where the workflow is now) and MAX_PER_LAYER
boxes per column, the last one "+N more" when the layer holds more steps;
a capped column draws first the steps that need attention (dead-lettered,
then in the queue). Laying out reads each step and edge a few times
(10,000 steps: a fraction of a second), and only the drawn steps get links
(the admin looks their rows up).

Every text is escaped (step names are the user's); a state is named in
the legend and in each box, never by colour alone.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

from django_pgqueue.models.workflows import StepState

MAX_LAYERS = 30
MAX_PER_LAYER = 12  # boxes in a column, "+N more" included
NAME_CHARS = 24  # of a step's name in its box (all of it in the box's tooltip)

# Sizes in SVG user units (pixels at 100%).
BOX_WIDTH, BOX_HEIGHT = 180, 40
COLUMN, ROW = BOX_WIDTH + 56, BOX_HEIGHT + 12  # from one box to the next
MARGIN = 12
LINE = 20  # the legend's and the note's height

# The Okabe-Ito palette, distinguishable with the common colour-vision
# deficiencies; the box is a light tint of it (readable text in the light
# and the dark theme) with a stripe and a border of the full colour.
COLOURS: dict[str, str] = {
    StepState.HELD: "#999999",
    StepState.RELEASED: "#0072B2",
    StepState.DONE: "#009E73",
    StepState.DEAD_LETTERED: "#D55E00",
    StepState.CANCELLED: "#CC79A7",
}
LABELS: dict[str, str] = {
    StepState.HELD: "held",
    StepState.RELEASED: "in the queue",
    StepState.DONE: "done",
    StepState.DEAD_LETTERED: "dead-lettered",
    StepState.CANCELLED: "cancelled",
}
# Which steps a capped column draws first.
PRIORITY: dict[str, int] = {
    StepState.DEAD_LETTERED: 0,
    StepState.RELEASED: 1,
    StepState.HELD: 2,
    StepState.CANCELLED: 3,
    StepState.DONE: 4,
}
NOW: set[str] = {StepState.RELEASED, StepState.DEAD_LETTERED}  # where a workflow is now


@dataclass(frozen=True)
class Node:
    """A step, as the graph needs it."""

    id: int
    name: str
    state: str
    topic: str = ""


@dataclass
class Box:
    """A drawn box at (x, y): a step, or "+N more" standing for ``hidden``."""

    x: int
    y: int
    node: Node | None = None
    hidden: list[Node] = field(default_factory=list)


@dataclass
class Layout:
    """Where the boxes go: ``edges`` are (box of a step, box of a step that
    runs after it), indexes into ``boxes``; ``before`` and ``after`` count
    the steps of the layers left out on either side."""

    boxes: list[Box]
    edges: list[tuple[int, int]]
    counts: Counter[str]
    layers: int
    first: int
    drawn_layers: int
    before: int
    after: int

    def drawn_steps(self) -> list[Node]:
        return [box.node for box in self.boxes if box.node is not None]

    @property
    def note(self) -> str:
        """What is left out, when anything is."""
        if not self.before and not self.after:
            return ""
        left_out = [
            f"{count:,} step(s) {where}"
            for count, where in [(self.before, "before"), (self.after, "after")]
            if count
        ]
        last = self.first + self.drawn_layers
        return (
            f"Layers {self.first + 1}–{last} of {self.layers:,} are drawn, not the "
            + " and the ".join(left_out)
            + " them."
        )


def layers_of(nodes: Sequence[Node], edges: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Each step's layer: 0 for those that follow none, else one more than
    the deepest step it follows. ``edges`` are (step, a step it runs
    after), as ``WorkflowDependency`` holds them. Kahn's order: each step
    and edge once."""
    waiting = {node.id: 0 for node in nodes}
    followers: defaultdict[int, list[int]] = defaultdict(list)
    for step, after in edges:
        if step in waiting and after in waiting:
            followers[after].append(step)
            waiting[step] += 1
    layer: dict[int, int] = {}
    ready = [pk for pk, count in waiting.items() if count == 0]
    for pk in ready:
        layer[pk] = 0
    while ready:
        pk = ready.pop()
        for follower in followers[pk]:
            layer[follower] = max(layer.get(follower, 0), layer[pk] + 1)
            waiting[follower] -= 1
            if waiting[follower] == 0:
                ready.append(follower)
    # A cycle: enqueue refuses one, but the rows are not checked again here;
    # its steps go after all the others rather than nowhere.
    deepest = max(layer.values(), default=-1) + 1
    for pk, count in waiting.items():
        if count:
            layer[pk] = deepest
    return layer


def lay_out(
    nodes: Sequence[Node],
    edges: Iterable[tuple[int, int]],
    max_layers: int = MAX_LAYERS,
    max_per_layer: int = MAX_PER_LAYER,
) -> Layout:
    """The boxes of ``nodes`` (in the order of their ids within a layer but
    near the steps they follow) and the arrows of ``edges`` ((step, a step
    it runs after)) between the drawn ones; a step hidden in a "+N more"
    box has its arrows drawn from and to that box."""
    edges = list(edges)
    layer = layers_of(nodes, edges)
    columns: list[list[Node]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for node in nodes:
        columns[layer[node.id]].append(node)
    first = _first_layer(columns, max_layers)
    shown = columns[first : first + max_layers]
    follows: defaultdict[int, list[int]] = defaultdict(list)
    for step, after in edges:
        follows[step].append(after)
    boxes: list[Box] = []
    box_of: dict[int, int] = {}  # step id -> index of the box it is drawn in

    def order(node: Node) -> tuple[float, int]:
        # The mean height of the drawn steps it follows: fewer crossings.
        ys = [boxes[box_of[pk]].y for pk in follows[node.id] if pk in box_of]
        return (sum(ys) / len(ys) if ys else 0.0, node.id)

    top = MARGIN + LINE * (3 if first or len(columns) > first + max_layers else 2)
    for c, column in enumerate(shown):
        drawn, hidden = column, []
        if len(column) > max_per_layer:
            drawn = sorted(column, key=lambda n: (PRIORITY.get(n.state, 9), order(n)))
            drawn, hidden = drawn[: max_per_layer - 1], drawn[max_per_layer - 1 :]
        x = MARGIN + c * COLUMN
        row = -1
        for row, node in enumerate(sorted(drawn, key=order)):
            box_of[node.id] = len(boxes)
            boxes.append(Box(x, top + row * ROW, node))
        if hidden:
            for node in hidden:
                box_of[node.id] = len(boxes)
            boxes.append(Box(x, top + (row + 1) * ROW, None, hidden))
    arrows = {
        (box_of[after], box_of[step]) for step, after in edges if step in box_of and after in box_of
    }
    return Layout(
        boxes=boxes,
        edges=sorted(arrows),
        counts=Counter(node.state for node in nodes),
        layers=len(columns),
        first=first,
        drawn_layers=len(shown),
        before=sum(len(c) for c in columns[:first]),
        after=sum(len(c) for c in columns[first + max_layers :]),
    )


def _first_layer(columns: Sequence[Sequence[Node]], max_layers: int) -> int:
    """The first layer drawn: 0, or, when there are more than
    ``max_layers``, the one before the first layer with a step in the queue
    or the dead letters (as far as there are layers after it)."""
    if len(columns) <= max_layers:
        return 0
    now = next((i for i, c in enumerate(columns) if any(n.state in NOW for n in c)), 0)
    return max(0, min(now - 1, len(columns) - max_layers))


def draw(layout: Layout, links: Mapping[int, str], graph_id: str, title: str) -> str:
    """The SVG of ``layout``: a legend with the steps' count by state, the
    arrows, and a box per drawn step, a link where ``links`` ({step id:
    URL}) has one. ``graph_id`` must be unique in the page."""
    gid = escape(graph_id)
    legend, legend_width = _legend(layout.counts)
    right = max((box.x + BOX_WIDTH for box in layout.boxes), default=0)
    bottom = max((box.y + BOX_HEIGHT for box in layout.boxes), default=MARGIN + LINE)
    width, height = max(right, legend_width) + MARGIN, bottom + MARGIN
    total = sum(layout.counts.values())
    desc = (
        f"{total:,} step(s) in {layout.layers:,} layer(s): "
        + ", ".join(f"{LABELS.get(s, s)} {n:,}" for s, n in _by_state(layout.counts))
        + ". An arrow goes from a step to each step that runs after it. "
        + layout.note
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="pgqueue-workflow-graph" id="{gid}" '
        f'role="group" aria-labelledby="{gid}-title {gid}-desc" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}">',
        f'<title id="{gid}-title">{escape(title)}</title>',
        f'<desc id="{gid}-desc">{escape(desc.strip())}</desc>',
        f'<defs><marker id="{gid}-arrow" viewBox="0 0 10 10" refX="10" refY="5" '
        'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        '<path d="M 0 0 L 10 5 L 0 10 z" fill="currentColor"/></marker></defs>',
        *legend,
    ]
    if layout.note:
        out.append(
            f'<text class="note" x="{MARGIN}" y="{MARGIN + LINE + 14}" font-size="12" '
            f'fill="currentColor">{escape(layout.note)}</text>'
        )
    for start, end in layout.edges:
        out.append(_arrow(layout.boxes[start], layout.boxes[end], gid))
    for box in layout.boxes:
        out.append(_step(box, links) if box.node is not None else _more(box))
    out.append("</svg>")
    return "\n".join(out)


def _by_state(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    return [(state, counts.get(state, 0)) for state in COLOURS]


def _legend(counts: Mapping[str, int]) -> tuple[list[str], int]:
    """The legend's markup, and how wide it is."""
    parts, x = [], MARGIN
    for state, count in _by_state(counts):
        text = f"{LABELS[state]} ({count:,})"
        parts.append(
            f'<g class="legend legend-{escape(state)}"><rect x="{x}" y="{MARGIN + 2}" width="12" '
            f'height="12" fill="{COLOURS[state]}"/><text x="{x + 16}" y="{MARGIN + 12}" '
            f'font-size="12" fill="currentColor">{escape(text)}</text></g>'
        )
        x += 30 + round(6.5 * len(text))  # about a 12px sans-serif's width
    return parts, x


def _arrow(start: Box, end: Box, gid: str) -> str:
    x1, y1 = start.x + BOX_WIDTH, start.y + BOX_HEIGHT / 2
    x2, y2 = end.x - 2, end.y + BOX_HEIGHT / 2
    bend = max((x2 - x1) / 2, 20)
    return (
        f'<path class="edge" d="M {x1} {y1:.0f} C {x1 + bend:.0f} {y1:.0f}, '
        f'{x2 - bend:.0f} {y2:.0f}, {x2} {y2:.0f}" fill="none" stroke="currentColor" '
        f'stroke-opacity="0.45" marker-end="url(#{gid}-arrow)"/>'
    )


def _step(box: Box, links: Mapping[int, str]) -> str:
    node = box.node
    assert node is not None
    colour, label = COLOURS.get(node.state, "#888888"), LABELS.get(node.state, node.state)
    name = node.name if len(node.name) <= NAME_CHARS else node.name[: NAME_CHARS - 1] + "…"
    tooltip = f"{node.name} ({node.topic}): {label}" if node.topic else f"{node.name}: {label}"
    shapes = (
        f"<title>{escape(tooltip)}</title>"
        f'<rect x="{box.x}" y="{box.y}" width="{BOX_WIDTH}" height="{BOX_HEIGHT}" rx="4" '
        f'fill="{colour}" fill-opacity="0.18" stroke="{colour}" stroke-width="2"/>'
        f'<rect x="{box.x}" y="{box.y}" width="6" height="{BOX_HEIGHT}" fill="{colour}"/>'
        f'<text x="{box.x + 12}" y="{box.y + 17}" font-size="12" font-weight="bold" '
        f'fill="currentColor">{escape(name)}</text>'
        f'<text x="{box.x + 12}" y="{box.y + 33}" font-size="11" '
        f'fill="currentColor">{escape(label)}</text>'
    )
    attributes = (
        f'class="step step-{escape(node.state)}" data-step="{node.id}" '
        f'data-state="{escape(node.state)}"'
    )
    url = links.get(node.id)
    if url is None:
        return f"<g {attributes}>{shapes}</g>"
    return f'<a href="{escape(url)}" {attributes}>{shapes}</a>'


def _more(box: Box) -> str:
    counts = Counter(node.state for node in box.hidden)
    states = ", ".join(f"{n:,} {LABELS.get(s, s)}" for s, n in _by_state(counts) if n)
    tooltip = f"{len(box.hidden):,} more step(s) in this layer: {states}"
    return (
        f'<g class="more"><title>{escape(tooltip)}</title>'
        f'<rect x="{box.x}" y="{box.y}" width="{BOX_WIDTH}" height="{BOX_HEIGHT}" rx="4" '
        'fill="none" stroke="currentColor" stroke-opacity="0.6" stroke-dasharray="4 3"/>'
        f'<text x="{box.x + BOX_WIDTH / 2:.0f}" y="{box.y + 25}" font-size="12" '
        f'text-anchor="middle" fill="currentColor">+{len(box.hidden):,} more</text></g>'
    )
