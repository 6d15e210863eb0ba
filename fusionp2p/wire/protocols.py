"""Versioned protocol ids and gossip topics (one home for every wire name)."""

from __future__ import annotations

PROBE = "/fusionp2p/probe/1.0.0"          # bandwidth / RTT probes
BULK_TICKET = "/fusionp2p/bulk-ticket/1.0.0"  # key agreement for the encrypted TCP side channel
CONTENT = "/fusionp2p/content/1.0.0"      # content-addressed blobs (DAG, weights, data shards)
TENSOR = "/fusionp2p/tensor/1.0.0"        # tensor frames over a libp2p stream (fallback path)
REACH = "/fusionp2p/reach/1.0.0"          # dial-back checks and connection reversal (swarm/reach.py)
JOB = "/fusionp2p/job/1.0.0"              # job control (submit, status, cancel, download)

TOPIC_MEMBERS = "fusionp2p/members/1"     # heartbeats and signed node records
TOPIC_BANDWIDTH = "fusionp2p/bandwidth/1"  # signed bandwidth measurements
TOPIC_JOBS = "fusionp2p/jobs/1"           # job announcements, plan hashes, progress
