"""Replicas controller: place, retire, roll and adopt replicas, and send the commands.

`plan` compares desired with actual state and says what to do (pure); `placement` picks
a node for one replica through named filters, each verdict explaining itself per node;
`verdicts` keeps a placement event small on a large fleet; `backoff` slows the
re-placement of a model whose shards keep failing; `commands` sends each command once and
re-issues it until answered; `controller` is the shell that runs them.
"""
