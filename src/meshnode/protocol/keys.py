"""Run-scoped DHT key names and the peer's RSA identity (the key that signs its DHT records).

Key names (``{run}`` = run name + short config hash, :attr:`RunConfig.run_id`):

* ``{run}_peers``: one subkey per peer (its public key), the :class:`~.records.PeerRecord`.
* ``{run}_prior_{stage}``: one subkey per (anchor, matrix), plus one header subkey per anchor.
* ``{run}_dp_{stage}``: the prefix of the stage's DP averaging groups (hivemind's averager).

DESIGN.md writes them with dots; hivemind's ``SchemaValidator`` maps a record to a schema field by
``{prefix}_{field}`` and its averager forbids dots in a group prefix, so the swarm uses underscores.

Identity file: the RSA private key in DER form (``meshnode join --identity FILE`` creates it when
missing). Its public key, as the ``ssh-rsa ...`` string :func:`public_key_string` returns, is what
``anchor.allowed_keys`` lists.
"""

from __future__ import annotations

import os
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey


def peers_key(run: str) -> str:
    return f"{run}_peers"


def prior_key(run: str, stage: int) -> str:
    """The stage's prior *headers* (one small signed value per anchor): what fast peers poll."""
    return f"{run}_prior_{stage}"


def prior_data_key(run: str, stage: int) -> str:
    """The stage's prior *factors* (one signed value per anchor and matrix): read only when a header is new."""
    return f"{run}_priordata_{stage}"


def dp_prefix(run: str, stage: int) -> str:
    return f"{run}_dp_{stage}"


def load_or_create_identity(path: str | Path | None) -> RSAPrivateKey:
    """The RSA key in ``path`` (DER), created there (mode 0600) when missing; a fresh key when ``path`` is None."""
    if path is None:
        return RSAPrivateKey()
    path = Path(path)
    if path.is_file():
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        try:
            key.__setstate__({"_private_key": path.read_bytes()})  # hivemind's own (pickle) deserialisation
        except Exception:
            raise ValueError(f"{path}: not an RSA private key (DER) written by meshnode") from None
        return key
    key = RSAPrivateKey()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    return key


def public_key_string(key: RSAPrivateKey) -> str:
    """The public key as ``ssh-rsa AAAA...`` (what ``anchor.allowed_keys`` lists)."""
    return key.get_public_key().to_bytes().decode()


def owner_tag(key: RSAPrivateKey) -> bytes:
    """``[owner:ssh-rsa ...]``: the marker that makes a subkey protected by RSASignatureValidator."""
    return RSASignatureValidator(key).local_public_key


def owner_of(subkey: bytes) -> str | None:
    """The ``ssh-rsa ...`` public key embedded in a protected subkey, or None."""
    if not isinstance(subkey, bytes):
        return None
    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)  # the validator's own pattern
    return found[0].decode() if len(set(found)) == 1 else None


__all__ = [
    "dp_prefix", "load_or_create_identity", "owner_of", "owner_tag", "peers_key", "prior_data_key", "prior_key",
    "public_key_string",
]
