#!/usr/bin/env python3
"""docs/architecture.md's tables of the agent's states and transitions against agent_sm.h.

Fails (exit 1, saying which name and where) when
  - a state of agent_sm_state_t has no line in the "| state | meaning |" table, or that table names
    a state the enum lacks;
  - an event of agent_sm_event_kind_t is in no event cell of the "| state | event | actions | next |"
    table, or an event cell names an event the enum lacks (every upper-case word there is one);
  - a state or next cell of that table names a state the enum lacks, or a state but DONE has no row;
  - an action of agent_sm_action_kind_t (but SAY, written "say") appears nowhere in the section,
    or an action cell has an upper-case word that is no action, event, state or signal name.
It reads the names only, not what a row says (a person checks that against agent_sm.c).
Standard library only; tests/run.sh runs it.
    tests/tools/check_agent_sm_doc.py
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(ROOT, "launcher", "agent", "agent_sm.h")
DOC = os.path.join(ROOT, "docs", "architecture.md")
SHOWN = "docs/architecture.md"  # in messages
SECTION = "### The agent's state machine"
WORD = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b")


def enum_names(text, typedef, prefix):
    """The names of `typedef enum { ... } typedef;` without their prefix."""
    m = re.search(r"typedef enum \{(.*?)\}\s*" + typedef + ";", text, re.S)
    if not m:
        sys.exit(f"launcher/agent/agent_sm.h: no enum {typedef}")
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return [n[len(prefix):] for n in re.findall(r"\b" + prefix + r"[A-Z0-9_]+", body)]


def table(lines, head):
    """The rows (lists of stripped cells) of the table whose header line is `head`."""
    for i, line in enumerate(lines):
        if line.strip() == head:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows, i + 3
    sys.exit(f"{SHOWN}: no table '{head}' in the section '{SECTION}'")


def main():
    header = open(HEADER).read()
    states = enum_names(header, "agent_sm_state_t", "AGENT_SM_")
    events = enum_names(header, "agent_sm_event_kind_t", "AGENT_EV_")
    actions = enum_names(header, "agent_sm_action_kind_t", "AGENT_ACT_")
    doc = open(DOC).read()
    if SECTION not in doc:
        sys.exit(f"{SHOWN}: no section '{SECTION}'")
    start = doc.index(SECTION)
    end = doc.find("\n#", start + len(SECTION))
    section = doc[start:end if end >= 0 else len(doc)]
    lines = section.split("\n")
    line0 = doc[:start].count("\n") + 1  # the section's first line in the file
    errors = []

    meaning, first = table(lines, "| state | meaning |")
    listed = [r[0] for r in meaning]
    for s in states:
        if s not in listed:
            errors.append(f"state {s} (agent_sm.h) has no line in the '| state | meaning |' table")
    for n, s in enumerate(listed):
        if s not in states:
            errors.append(f"{SHOWN}:{line0 + first + n - 1}: state {s} is not in agent_sm.h")

    rows, first = table(lines, "| state | event | actions | next |")
    seen_events, from_states = set(), set()
    names = set(states) | set(events) | set(actions)
    for n, r in enumerate(rows):
        where = f"{SHOWN}:{line0 + first + n - 1}"
        if len(r) != 4:
            errors.append(f"{where}: {len(r)} cells, want 4")
            continue
        state, event, acts, nxt = r
        for w in WORD.findall(state):
            if w not in states:
                errors.append(f"{where}: state cell names {w}, not a state of agent_sm.h")
            from_states.add(w)
        for w in WORD.findall(event):
            if w not in events:
                errors.append(f"{where}: event cell names {w}, not an event of agent_sm.h")
            seen_events.add(w)
        for w in WORD.findall(acts):
            if w not in names and not w.startswith("SIG"):
                errors.append(f"{where}: action cell names {w}: no action, event or state")
        for w in WORD.findall(nxt):
            if w not in states:
                errors.append(f"{where}: next cell names {w}, not a state of agent_sm.h")
    for e in events:
        if e not in seen_events:
            errors.append(f"event {e} (agent_sm.h) is in no event cell of the transition table")
    for s in states:
        if s != "DONE" and s not in from_states:
            errors.append(f"state {s} (agent_sm.h) has no row in the transition table")
    words = set(WORD.findall(section))
    for a in actions:
        if a != "SAY" and a not in words:
            errors.append(f"action {a} (agent_sm.h) is not mentioned in '{SECTION}'")

    for e in errors:
        print(f"check_agent_sm_doc: {e}", file=sys.stderr)
    if errors:
        print(f"check_agent_sm_doc: docs/architecture.md's state machine tables and agent_sm.h "
              f"part ({len(errors)} problems)", file=sys.stderr)
        return 1
    print(f"agent_sm tables: {len(states)} states, {len(events)} events, {len(rows)} transitions "
          f"match agent_sm.h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
