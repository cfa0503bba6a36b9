"""Step 2 of an event's path, `intake -> state -> store -> controllers`: the folded state. Pure.

`model` is the cluster state the log describes and nothing else; `fold` applies one event
to it and reports what changed (`changes`); `checks` refuses events no honest writer
sends; `queries` answers the questions every controller asks of the state, in one place;
`replica_index` keeps the next replica id O(1); `ids` builds and parses every id the
reconciler makes; `wording` writes times, sizes and counts the one way explanations use.
"""
