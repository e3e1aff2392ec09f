"""The spec's parts about who may reach a deployment: the router's API keys and the
NetworkPolicies.

`RouterSpec.apiKeySecret` names a Secret key the router pods read as `DISTSERVE_API_KEY`
(comma-separated keys; `/v1` then needs `Authorization: Bearer KEY`). `NetworkPolicySpec`
says whether the operator puts NetworkPolicies in front of the pods and who, beyond the
deployment's own pods and the operator, may reach them: `apiFrom` the router's API port,
`metricsFrom` the instances' metrics. Both take Kubernetes NetworkPolicyPeer objects as
they are written in a NetworkPolicy (`podSelector`, `namespaceSelector`, `ipBlock`),
typed here so that the CRD refuses a misspelt field.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from distserve.spec_base import SpecModel
from distserve.spec_pods import SecretKeyRef


class LabelSelectorRequirement(SpecModel):
    """One expression of a label selector."""

    key: str = Field(min_length=1, description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist.")
    values: list[str] | None = Field(
        default=None, description="Values for In and NotIn; empty for Exists and DoesNotExist.")

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        needs_values = self.operator in ("In", "NotIn")
        if needs_values != bool(self.values):
            raise ValueError(f"operator {self.operator}: values must be "
                             f"{'non-empty' if needs_values else 'empty'}")
        return self


class LabelSelector(SpecModel):
    """A Kubernetes label selector; empty selects everything."""

    match_labels: dict[str, str] | None = Field(default=None, description="Labels to match.")
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, description="Expressions to match.")


class IPBlock(SpecModel):
    """Addresses outside the cluster's pods (a load balancer's or an office's range)."""

    cidr: str = Field(description="A CIDR such as 10.0.0.0/8.")
    except_: list[str] | None = Field(default=None, alias="except",
                                      description="CIDRs inside cidr to leave out.")

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, value: str) -> str:
        ipaddress.ip_network(value, strict=False)  # a ValueError names the bad value
        return value

    @field_validator("except_")
    @classmethod
    def _excepts(cls, values: list[str] | None) -> list[str] | None:
        for value in values or []:
            ipaddress.ip_network(value, strict=False)
        return values


class PolicyPeer(SpecModel):
    """A NetworkPolicyPeer: pods by labels (in namespaces by labels), or an IP block."""

    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods by labels (in the deployment's namespace unless "
        "namespaceSelector is set too).")
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces by labels ({} is every namespace; one by name: "
        "matchLabels: {kubernetes.io/metadata.name: NAME}).")
    ip_block: IPBlock | None = Field(default=None, description="Addresses by CIDR.")

    @model_validator(mode="after")
    def _one_kind(self) -> PolicyPeer:
        if self.ip_block is None and self.pod_selector is None and self.namespace_selector is None:
            raise ValueError("set podSelector, namespaceSelector or ipBlock")
        if self.ip_block is not None and (self.pod_selector or self.namespace_selector):
            raise ValueError("ipBlock cannot be combined with podSelector or namespaceSelector")
        return self


class NetworkPolicySpec(SpecModel):
    """The NetworkPolicies the operator keeps next to the deployment's pods."""

    # NOTE: strict, as the CRD is: a lax bool would take 1 or "yes" the API server refuses.
    enabled: StrictBool = Field(
        default=True, description="Keep two NetworkPolicies: the instances (KV, prefill, "
        "decode endpoints) accept traffic only from the deployment's own pods, the operator "
        "and metricsFrom; the router accepts its API port from apiFrom. Needs a network "
        "plugin that enforces NetworkPolicies, and the operator's chart value "
        "networkPolicy.enabled.")
    api_from: list[PolicyPeer] | None = Field(
        default=None, min_length=1, description="Who may reach the router's API port "
        "(NetworkPolicyPeers). Unset: the operator's default (the chart's "
        "networkPolicy.apiFrom; empty there: any source).")
    metrics_from: list[PolicyPeer] | None = Field(
        default=None, min_length=1, description="Who may scrape /metrics on the instances' "
        "and the router's port (NetworkPolicyPeers). Unset: the operator's default (the "
        "chart's networkPolicy.metricsFrom: pods labelled app.kubernetes.io/name=prometheus "
        "in any namespace).")


class RouterSpec(SpecModel):
    """The router's own settings (its pod options are spec.engine.router)."""

    api_key_secret: SecretKeyRef | None = Field(
        default=None, description="A Secret key holding the API keys (comma-separated) the "
        "router requires on /v1 as `Authorization: Bearer KEY`, given to the router pods as "
        "DISTSERVE_API_KEY. Unset: the API is open to whoever reaches the router.")
    admit_by_ttft: bool = Field(
        default=False, description="Refuse a request at once (429 with Retry-After) when "
        "the router predicts that the prompts queued ahead of it would delay its first "
        "token past slo.ttftSeconds, rather than serve it late and delay the requests "
        "behind it too. The prediction is a line in the queued prompt tokens, fitted on the "
        "TTFTs the router has seen; nothing is refused on this ground before 16 requests. "
        "The planner's simulator refuses the same way, each refusal counted as a miss, and "
        "so do the predictions of a local deployment (`distserve up --demo`, `distserve "
        "fidelity`).")
