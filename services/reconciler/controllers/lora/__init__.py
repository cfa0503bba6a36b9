"""LoRA adapter placement: which replicas of a base model hold which adapters.

The leader's step after replicas are placed and ready: `placement.py` decides (pure,
with hysteresis so a skewed workload does not thrash), `controller.py` feeds it the
routers' demand per adapter, records each decision as AdaptersPlaced and tells each
changed replica's agent the whole set its engine should hold (SetShardAdapters).
"""
