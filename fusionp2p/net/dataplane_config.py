"""Settings of a node's data plane (:class:`DataPlaneConfig`) and the names of a channel's paths.

Read by the direct channel (``net/bulk_channel.py``), the libp2p stream channel
(``net/stream_channel.py``) and the data plane that opens both (``net/bulk.py``); docs/dataplane.md
and docs/networking.md describe the settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusionp2p.errors import ConfigError
from fusionp2p.net.aead import CIPHERS, default_cipher
from fusionp2p.net.shaping import LinkEmulator
from fusionp2p.wire import tensor_frame as tf
from fusionp2p.wire.limits import DEFAULT_LIMITS, GiB, KiB, Limits, MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlaneConfig:
    """Settings of a node's data plane."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None   # address peers should dial (default: the bound address)
    advertise_port: int = 0             # port peers should dial (0: the bound port; e.g. a NAT's forwarded port)
    fallback: bool = True               # no direct TCP connection possible: tensors over the libp2p stream
    direct_timeout: float = 3.0         # for the TCP connects of a direct channel, before falling back
    direct_retry: float = 60.0          # after a failed direct dial, a peer is dialled on the fallback path this long
    cipher: str = field(default_factory=default_cipher)
    window: int = 8                     # messages in flight per direction
    chunk_size: int = 1 * MiB           # plaintext bytes per record (fits L2 with the socket copy: less CPU than 4 MiB)
    inline_seal: int = 2 * MiB          # messages up to this size are sealed by send() itself, bigger ones by the writer thread
    keepalive: float = 0.5              # seconds between PINGs on an idle channel
    dead_after: float = 3.0             # seconds of silence before PeerUnavailable (a killed peer is seen at once: reset or EOF)
    connect_timeout: float = 5.0        # a channel's set-up once the libp2p connection is up (getting that: the transport's deadlines)
    ticket_ttl: float = 10.0
    incoming_buffer: int = 16
    socket_buffer: int = 0              # SO_SNDBUF/SO_RCVBUF; 0 keeps Linux autotuning (faster on loopback)
    lanes: int = 2                      # TCP connections per channel (a dialer asks, the listener grants at most its own)
    stripe_min: int = 8 * MiB           # messages from this size on are striped over the lanes
    insecure_plaintext_for_tests: bool = False
    emulator: LinkEmulator | None = None   # emulated link rates (Swarm.local(links=...)): sends are shaped
    limits: Limits = DEFAULT_LIMITS
    # what one peer, and all peers together, may cost this node (net/admission.py)
    max_handshakes: int = 64            # ticket exchanges and TCP lanes waiting for their ticket, at once
    max_peer_tickets: int = 4           # tickets issued to one peer and not used yet
    max_channels: int = 256             # accepted channels open at once (each: 2 threads per lane)
    max_peer_channels: int = 16
    max_buffered: int = 4 * GiB         # incoming message bytes held (announced, not yet taken by the application)
    max_peer_buffered: int = 1 * GiB

    def __post_init__(self) -> None:
        if self.cipher not in CIPHERS:
            raise ConfigError(f"DataPlaneConfig.cipher must be one of {CIPHERS}")
        if self.cipher == "none" and not self.insecure_plaintext_for_tests:
            raise ConfigError("cipher 'none' sends tensors in the clear; it needs insecure_plaintext_for_tests=True")
        if not 1 <= self.lanes <= tf.MAX_LANES:
            raise ConfigError(f"DataPlaneConfig.lanes must be between 1 and {tf.MAX_LANES}")
        if self.window < 1 or self.incoming_buffer < 1:
            raise ConfigError("DataPlaneConfig.window and incoming_buffer must be >= 1")
        if not 1 * KiB <= self.chunk_size <= self.limits.max_frame:
            raise ConfigError("DataPlaneConfig.chunk_size must be between 1 KiB and limits.max_frame")
        if not 0 < self.keepalive < self.dead_after:
            raise ConfigError("DataPlaneConfig needs 0 < keepalive < dead_after")
        if min(self.connect_timeout, self.ticket_ttl, self.direct_timeout) <= 0 or self.direct_retry < 0:
            raise ConfigError("DataPlaneConfig timeouts must be positive")
        if not 0 <= self.listen_port < 65536 or not 0 <= self.advertise_port < 65536:
            raise ConfigError("DataPlaneConfig ports must be between 0 and 65535")
        if min(self.max_handshakes, self.max_peer_tickets, self.max_channels, self.max_peer_channels,
               self.max_buffered, self.max_peer_buffered) < 1:
            raise ConfigError("DataPlaneConfig caps (max_handshakes ... max_peer_buffered) must be positive")


PATH_DIRECT = "direct"   # BulkChannel: TCP to the peer's data-plane port, our own AEAD
PATH_LIBP2P = "libp2p"   # StreamChannel: a stream on the libp2p connection the peers share (net/stream_channel.py)
PATH_RELAY = "relay"     # the same, on a libp2p connection that a circuit relay carries (net/relay.py)


__all__ = ["PATH_DIRECT", "PATH_LIBP2P", "PATH_RELAY", "DataPlaneConfig"]
