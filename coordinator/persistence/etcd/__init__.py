"""The coordinator's state in etcd (`--state etcd://...`): a v3 API client, the persistence and leader election."""

from axond.coordinator.persistence.etcd.client import EtcdClient, EtcdError, parse_state_url
from axond.coordinator.persistence.etcd.election import LeaderElection, Term
from axond.coordinator.persistence.etcd.persistence import EtcdPersistence, NotLeader

__all__ = ["EtcdClient", "EtcdError", "EtcdPersistence", "LeaderElection", "NotLeader", "Term", "parse_state_url"]
