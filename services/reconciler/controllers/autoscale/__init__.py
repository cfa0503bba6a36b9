"""Autoscale controller: replica counts from the routers' demand summaries.

`rule` is the pure decision (hysteresis, cool-downs, scale to zero and back);
`controller` collects the routers' summaries, asks the rule on each tick and
publishes each change as a `ModelScaled` event.
"""
