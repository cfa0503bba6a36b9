"""Autoscale controller: replica counts from the routers' demand summaries.

`rule` is the pure decision (hysteresis, cool-downs, scale to zero and back); `demand`
collects the routers' summaries; `controller` runs them as one of the leader's
controllers and publishes each change as a `ModelScaled` event.
"""
