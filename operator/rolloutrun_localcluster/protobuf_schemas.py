"""The protobuf message schemas of the built-in kinds kubectl creates, as a table.

kubectl (and every client-go program) sends built-in types as
``application/vnd.kubernetes.protobuf``; the emulator stores JSON. These are the facts of that
wire format the decoder in ``protobuf.py`` needs, transcribed from the ``generated.proto``
files of k8s.io/api (core, rbac, authentication, authorization, scheduling, policy,
coordination, networking v1; apps v1 in ``protobuf_schemas_apps``) and
k8s.io/apimachinery (meta v1): per message, its fields as
``<number> <JSON name> <type>``, comma-separated. Types: ``s`` string, ``i`` integer
(int32/int64), ``b`` bool, ``y`` bytes (base64 in JSON), ``d`` double, a message name,
``[T]`` repeated, ``{s:T}`` a map. The names are the JSON names; the one proto name that
differs (``BoundObjectReference.uID``) is written as JSON spells it. ``Time``,
``MicroTime``, ``Quantity``, ``IntOrString``, ``RawExtension`` and ``FieldsV1`` have a JSON
form of their own and are decoded by name in ``protobuf.py``, as are the ``STRING_LISTS``.

Only the closure of the kinds in ``ROOTS`` is here: another kind sent as protobuf is refused
with a 415 naming it (send it as JSON, as ``kubectl apply`` does).
"""

from __future__ import annotations

# (apiVersion, kind) -> the message the object is encoded as.
ROOTS: dict[tuple[str, str], str] = {
    ("v1", "Namespace"): "Namespace",
    ("v1", "ConfigMap"): "ConfigMap",
    ("v1", "Secret"): "Secret",
    ("v1", "ServiceAccount"): "ServiceAccount",
    ("v1", "Service"): "Service",
    ("v1", "ResourceQuota"): "ResourceQuota",
    ("v1", "Event"): "Event",
    ("v1", "Pod"): "Pod",
    ("rbac.authorization.k8s.io/v1", "Role"): "Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "RoleBinding",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "ClusterRoleBinding",
    ("authentication.k8s.io/v1", "TokenRequest"): "TokenRequest",
    ("authentication.k8s.io/v1", "SelfSubjectReview"): "SelfSubjectReview",
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): "SelfSubjectAccessReview",
    ("authorization.k8s.io/v1", "SubjectAccessReview"): "SubjectAccessReview",
    ("authorization.k8s.io/v1", "LocalSubjectAccessReview"): "LocalSubjectAccessReview",
    ("authorization.k8s.io/v1", "SelfSubjectRulesReview"): "SelfSubjectRulesReview",
    ("scheduling.k8s.io/v1", "PriorityClass"): "PriorityClass",
    ("policy/v1", "PodDisruptionBudget"): "PodDisruptionBudget",
    ("policy/v1", "Eviction"): "Eviction",
    ("coordination.k8s.io/v1", "Lease"): "Lease",
    ("networking.k8s.io/v1", "NetworkPolicy"): "NetworkPolicy",
}

# Kinds registered in every group version (their apiVersion is the client's, e.g. a typed
# client's ``Delete`` sends ``v1, Kind=DeleteOptions``; an eviction, ``policy/v1``).
ANY_VERSION: frozenset[str] = frozenset({"DeleteOptions"})

# Messages that wrap a Go ``[]string`` (``type ExtraValue []string``): one ``repeated string
# items = 1`` on the wire, the bare list in JSON.
STRING_LISTS: frozenset[str] = frozenset({"ExtraValue", "AttestationValue"})

# Pointer fields of the Go types: present on the wire only when set, so a zero value there
# means what it says (``automountServiceAccountToken: false``, ``runAsUser: 0``). Every other
# scalar is always on the wire and its zero value means "unset" (JSON's ``omitempty``).
KEEP_ZERO: frozenset[str] = frozenset(
    {
        "activeDeadlineSeconds",
        "allocateLoadBalancerNodePorts",
        "allowPrivilegeEscalation",
        "automountServiceAccountToken",
        "defaultMode",
        "enableServiceLinks",
        "expirationSeconds",
        "fsGroup",
        "gracePeriodSeconds",
        "hostUsers",
        "immutable",
        "mode",
        "optional",
        "orphanDependents",
        "privileged",
        "readOnlyRootFilesystem",
        "runAsGroup",
        "runAsNonRoot",
        "runAsUser",
        "shareProcessNamespace",
        "terminationGracePeriodSeconds",
    }
)

# The fields of Container, and of EphemeralContainerCommon: upstream keeps the two identical
# (same names, same numbers), so they are written once.
CONTAINER = (
    "1 name s, 2 image s, 3 command [s], 4 args [s], 5 workingDir s, "
    "6 ports [ContainerPort], 7 env [EnvVar], 8 resources ResourceRequirements, "
    "9 volumeMounts [VolumeMount], 10 livenessProbe Probe, 11 readinessProbe Probe, "
    "12 lifecycle Lifecycle, 13 terminationMessagePath s, 14 imagePullPolicy s, "
    "15 securityContext SecurityContext, 16 stdin b, 17 stdinOnce b, 18 tty b, "
    "19 envFrom [EnvFromSource], 20 terminationMessagePolicy s, "
    "21 volumeDevices [VolumeDevice], 22 startupProbe Probe, "
    "23 resizePolicy [ContainerResizePolicy], 24 restartPolicy s, "
    "25 restartPolicyRules [ContainerRestartRule]"
)

MESSAGES: dict[str, str] = {
    "Namespace": "1 metadata ObjectMeta, 2 spec NamespaceSpec, 3 status NamespaceStatus",
    "ObjectMeta": (
        "1 name s, 2 generateName s, 3 namespace s, 4 selfLink s, 5 uid s, "
        "6 resourceVersion s, 7 generation i, 8 creationTimestamp Time, "
        "9 deletionTimestamp Time, 10 deletionGracePeriodSeconds i, 11 labels {s:s}, "
        "12 annotations {s:s}, 13 ownerReferences [OwnerReference], 14 finalizers [s], "
        "17 managedFields [ManagedFieldsEntry]"
    ),
    "OwnerReference": (
        "1 kind s, 3 name s, 4 uid s, 5 apiVersion s, 6 controller b, 7 blockOwnerDeletion b"
    ),
    "ManagedFieldsEntry": (
        "1 manager s, 2 operation s, 3 apiVersion s, 4 time Time, 6 fieldsType s, "
        "7 fieldsV1 FieldsV1, 8 subresource s"
    ),
    "NamespaceSpec": "1 finalizers [s]",
    "NamespaceStatus": "1 phase s, 2 conditions [NamespaceCondition]",
    "NamespaceCondition": (
        "1 type s, 2 status s, 4 lastTransitionTime Time, 5 reason s, 6 message s"
    ),
    "ConfigMap": "1 metadata ObjectMeta, 2 data {s:s}, 3 binaryData {s:y}, 4 immutable b",
    "Secret": "1 metadata ObjectMeta, 2 data {s:y}, 3 type s, 4 stringData {s:s}, 5 immutable b",
    "ServiceAccount": (
        "1 metadata ObjectMeta, 2 secrets [ObjectReference], "
        "3 imagePullSecrets [LocalObjectReference], 4 automountServiceAccountToken b"
    ),
    "ObjectReference": (
        "1 kind s, 2 namespace s, 3 name s, 4 uid s, 5 apiVersion s, 6 resourceVersion s, "
        "7 fieldPath s"
    ),
    "LocalObjectReference": "1 name s",
    "Service": "1 metadata ObjectMeta, 2 spec ServiceSpec, 3 status ServiceStatus",
    "ServiceSpec": (
        "1 ports [ServicePort], 2 selector {s:s}, 3 clusterIP s, 4 type s, 5 externalIPs [s], "
        "7 sessionAffinity s, 8 loadBalancerIP s, 9 loadBalancerSourceRanges [s], "
        "10 externalName s, 11 externalTrafficPolicy s, 12 healthCheckNodePort i, "
        "13 publishNotReadyAddresses b, 14 sessionAffinityConfig SessionAffinityConfig, "
        "17 ipFamilyPolicy s, 18 clusterIPs [s], 19 ipFamilies [s], "
        "20 allocateLoadBalancerNodePorts b, 21 loadBalancerClass s, "
        "22 internalTrafficPolicy s, 23 trafficDistribution s"
    ),
    "ServicePort": (
        "1 name s, 2 protocol s, 3 port i, 4 targetPort IntOrString, 5 nodePort i, 6 appProtocol s"
    ),
    "SessionAffinityConfig": "1 clientIP ClientIPConfig",
    "ClientIPConfig": "1 timeoutSeconds i",
    "ServiceStatus": "1 loadBalancer LoadBalancerStatus, 2 conditions [Condition]",
    "LoadBalancerStatus": "1 ingress [LoadBalancerIngress]",
    "LoadBalancerIngress": "1 ip s, 2 hostname s, 3 ipMode s, 4 ports [PortStatus]",
    "PortStatus": "1 port i, 2 protocol s, 3 error s",
    "Condition": (
        "1 type s, 2 status s, 3 observedGeneration i, 4 lastTransitionTime Time, 5 reason s, "
        "6 message s"
    ),
    "Role": "1 metadata ObjectMeta, 2 rules [PolicyRule]",
    "PolicyRule": (
        "1 verbs [s], 2 apiGroups [s], 3 resources [s], 4 resourceNames [s], 5 nonResourceURLs [s]"
    ),
    "RoleBinding": "1 metadata ObjectMeta, 2 subjects [Subject], 3 roleRef RoleRef",
    "Subject": "1 kind s, 2 apiGroup s, 3 name s, 4 namespace s",
    "RoleRef": "1 apiGroup s, 2 kind s, 3 name s",
    "ClusterRole": (
        "1 metadata ObjectMeta, 2 rules [PolicyRule], 3 aggregationRule AggregationRule"
    ),
    "AggregationRule": "1 clusterRoleSelectors [LabelSelector]",
    "LabelSelector": "1 matchLabels {s:s}, 2 matchExpressions [LabelSelectorRequirement]",
    "LabelSelectorRequirement": "1 key s, 2 operator s, 3 values [s]",
    "ClusterRoleBinding": "1 metadata ObjectMeta, 2 subjects [Subject], 3 roleRef RoleRef",
    "ResourceQuota": (
        "1 metadata ObjectMeta, 2 spec ResourceQuotaSpec, 3 status ResourceQuotaStatus"
    ),
    "ResourceQuotaSpec": "1 hard {s:Quantity}, 2 scopes [s], 3 scopeSelector ScopeSelector",
    "ScopeSelector": "1 matchExpressions [ScopedResourceSelectorRequirement]",
    "ScopedResourceSelectorRequirement": "1 scopeName s, 2 operator s, 3 values [s]",
    "ResourceQuotaStatus": "1 hard {s:Quantity}, 2 used {s:Quantity}",
    "TokenRequest": "1 metadata ObjectMeta, 2 spec TokenRequestSpec, 3 status TokenRequestStatus",
    "TokenRequestSpec": (
        "1 audiences [s], 3 boundObjectRef BoundObjectReference, 4 expirationSeconds i, "
        "5 attestations {s:AttestationValue}"
    ),
    "BoundObjectReference": "1 kind s, 2 apiVersion s, 3 name s, 4 uid s",
    "TokenRequestStatus": "1 token s, 2 expirationTimestamp Time",
    "SelfSubjectReview": "1 metadata ObjectMeta, 2 status SelfSubjectReviewStatus",
    "SelfSubjectReviewStatus": "1 userInfo UserInfo",
    "UserInfo": "1 username s, 2 uid s, 3 groups [s], 4 extra {s:ExtraValue}",
    "SelfSubjectAccessReview": (
        "1 metadata ObjectMeta, 2 spec SelfSubjectAccessReviewSpec, "
        "3 status SubjectAccessReviewStatus"
    ),
    "SelfSubjectAccessReviewSpec": (
        "1 resourceAttributes ResourceAttributes, 2 nonResourceAttributes NonResourceAttributes"
    ),
    "ResourceAttributes": (
        "1 namespace s, 2 verb s, 3 group s, 4 version s, 5 resource s, 6 subresource s, "
        "7 name s, 8 fieldSelector FieldSelectorAttributes, "
        "9 labelSelector LabelSelectorAttributes"
    ),
    "FieldSelectorAttributes": "1 rawSelector s, 2 requirements [FieldSelectorRequirement]",
    "FieldSelectorRequirement": "1 key s, 2 operator s, 3 values [s]",
    "LabelSelectorAttributes": "1 rawSelector s, 2 requirements [LabelSelectorRequirement]",
    "NonResourceAttributes": "1 path s, 2 verb s",
    "SubjectAccessReview": (
        "1 metadata ObjectMeta, 2 spec SubjectAccessReviewSpec, 3 status SubjectAccessReviewStatus"
    ),
    "LocalSubjectAccessReview": (
        "1 metadata ObjectMeta, 2 spec SubjectAccessReviewSpec, 3 status SubjectAccessReviewStatus"
    ),
    "SubjectAccessReviewSpec": (
        "1 resourceAttributes ResourceAttributes, 2 nonResourceAttributes NonResourceAttributes, "
        "3 user s, 4 groups [s], 5 extra {s:ExtraValue}, 6 uid s"
    ),
    "SubjectAccessReviewStatus": "1 allowed b, 2 reason s, 3 evaluationError s, 4 denied b",
    "SelfSubjectRulesReview": (
        "1 metadata ObjectMeta, 2 spec SelfSubjectRulesReviewSpec, "
        "3 status SubjectRulesReviewStatus"
    ),
    "SelfSubjectRulesReviewSpec": "1 namespace s",
    "SubjectRulesReviewStatus": (
        "1 resourceRules [ResourceRule], 2 nonResourceRules [NonResourceRule], 3 incomplete b, "
        "4 evaluationError s"
    ),
    "ResourceRule": "1 verbs [s], 2 apiGroups [s], 3 resources [s], 4 resourceNames [s]",
    "NonResourceRule": "1 verbs [s], 2 nonResourceURLs [s]",
    "PriorityClass": (
        "1 metadata ObjectMeta, 2 value i, 3 globalDefault b, 4 description s, 5 preemptionPolicy s"
    ),
    "PodDisruptionBudget": (
        "1 metadata ObjectMeta, 2 spec PodDisruptionBudgetSpec, 3 status PodDisruptionBudgetStatus"
    ),
    "PodDisruptionBudgetSpec": (
        "1 minAvailable IntOrString, 2 selector LabelSelector, 3 maxUnavailable IntOrString, "
        "4 unhealthyPodEvictionPolicy s"
    ),
    "PodDisruptionBudgetStatus": (
        "1 observedGeneration i, 2 disruptedPods {s:Time}, 3 disruptionsAllowed i, "
        "4 currentHealthy i, 5 desiredHealthy i, 6 expectedPods i, 7 conditions [Condition]"
    ),
    "Lease": "1 metadata ObjectMeta, 2 spec LeaseSpec",
    "LeaseSpec": (
        "1 holderIdentity s, 2 leaseDurationSeconds i, 3 acquireTime MicroTime, "
        "4 renewTime MicroTime, 5 leaseTransitions i, 6 strategy s, 7 preferredHolder s"
    ),
    "NetworkPolicy": "1 metadata ObjectMeta, 2 spec NetworkPolicySpec",
    "NetworkPolicySpec": (
        "1 podSelector LabelSelector, 2 ingress [NetworkPolicyIngressRule], "
        "3 egress [NetworkPolicyEgressRule], 4 policyTypes [s]"
    ),
    "NetworkPolicyIngressRule": "1 ports [NetworkPolicyPort], 2 from [NetworkPolicyPeer]",
    "NetworkPolicyPort": "1 protocol s, 2 port IntOrString, 3 endPort i",
    "NetworkPolicyPeer": (
        "1 podSelector LabelSelector, 2 namespaceSelector LabelSelector, 3 ipBlock IPBlock"
    ),
    "IPBlock": "1 cidr s, 2 except [s]",
    "NetworkPolicyEgressRule": "1 ports [NetworkPolicyPort], 2 to [NetworkPolicyPeer]",
    "Event": (
        "1 metadata ObjectMeta, 2 involvedObject ObjectReference, 3 reason s, 4 message s, "
        "5 source EventSource, 6 firstTimestamp Time, 7 lastTimestamp Time, 8 count i, "
        "9 type s, 10 eventTime MicroTime, 11 series EventSeries, 12 action s, "
        "13 related ObjectReference, 14 reportingComponent s, 15 reportingInstance s"
    ),
    "EventSource": "1 component s, 2 host s",
    "EventSeries": "1 count i, 2 lastObservedTime MicroTime",
    "Pod": "1 metadata ObjectMeta, 2 spec PodSpec, 3 status PodStatus",
    "PodSpec": (
        "1 volumes [Volume], 2 containers [Container], 3 restartPolicy s, "
        "4 terminationGracePeriodSeconds i, 5 activeDeadlineSeconds i, 6 dnsPolicy s, "
        "7 nodeSelector {s:s}, 8 serviceAccountName s, 9 serviceAccount s, 10 nodeName s, "
        "11 hostNetwork b, 12 hostPID b, 13 hostIPC b, 14 securityContext PodSecurityContext, "
        "15 imagePullSecrets [LocalObjectReference], 16 hostname s, 17 subdomain s, "
        "18 affinity Affinity, 19 schedulerName s, 20 initContainers [Container], "
        "21 automountServiceAccountToken b, 22 tolerations [Toleration], "
        "23 hostAliases [HostAlias], 24 priorityClassName s, 25 priority i, "
        "26 dnsConfig PodDNSConfig, 27 shareProcessNamespace b, "
        "28 readinessGates [PodReadinessGate], 29 runtimeClassName s, 30 enableServiceLinks b, "
        "31 preemptionPolicy s, 32 overhead {s:Quantity}, "
        "33 topologySpreadConstraints [TopologySpreadConstraint], "
        "34 ephemeralContainers [EphemeralContainer], 35 setHostnameAsFQDN b, 36 os PodOS, "
        "37 hostUsers b, 38 schedulingGates [PodSchedulingGate], "
        "39 resourceClaims [PodResourceClaim], 40 resources ResourceRequirements, "
        "41 hostnameOverride s, 43 schedulingGroup PodSchedulingGroup, "
        "44 evictionResponders [EvictionResponder]"
    ),
    "Volume": "1 name s, 2 volumeSource VolumeSource",
    "VolumeSource": (
        "1 hostPath HostPathVolumeSource, 2 emptyDir EmptyDirVolumeSource, "
        "3 gcePersistentDisk GCEPersistentDiskVolumeSource, "
        "4 awsElasticBlockStore AWSElasticBlockStoreVolumeSource, "
        "5 gitRepo GitRepoVolumeSource, 6 secret SecretVolumeSource, 7 nfs NFSVolumeSource, "
        "8 iscsi ISCSIVolumeSource, 9 glusterfs GlusterfsVolumeSource, "
        "10 persistentVolumeClaim PersistentVolumeClaimVolumeSource, 11 rbd RBDVolumeSource, "
        "12 flexVolume FlexVolumeSource, 13 cinder CinderVolumeSource, "
        "14 cephfs CephFSVolumeSource, 15 flocker FlockerVolumeSource, "
        "16 downwardAPI DownwardAPIVolumeSource, 17 fc FCVolumeSource, "
        "18 azureFile AzureFileVolumeSource, 19 configMap ConfigMapVolumeSource, "
        "20 vsphereVolume VsphereVirtualDiskVolumeSource, 21 quobyte QuobyteVolumeSource, "
        "22 azureDisk AzureDiskVolumeSource, "
        "23 photonPersistentDisk PhotonPersistentDiskVolumeSource, "
        "24 portworxVolume PortworxVolumeSource, 25 scaleIO ScaleIOVolumeSource, "
        "26 projected ProjectedVolumeSource, 27 storageos StorageOSVolumeSource, "
        "28 csi CSIVolumeSource, 29 ephemeral EphemeralVolumeSource, "
        "30 image ImageVolumeSource"
    ),
    "HostPathVolumeSource": "1 path s, 2 type s",
    "EmptyDirVolumeSource": "1 medium s, 2 sizeLimit Quantity, 3 mode i",
    "GCEPersistentDiskVolumeSource": "1 pdName s, 2 fsType s, 3 partition i, 4 readOnly b",
    "AWSElasticBlockStoreVolumeSource": "1 volumeID s, 2 fsType s, 3 partition i, 4 readOnly b",
    "GitRepoVolumeSource": "1 repository s, 2 revision s, 3 directory s",
    "SecretVolumeSource": (
        "1 secretName s, 2 items [KeyToPath], 3 defaultMode i, 4 optional b, 5 defaultUser i"
    ),
    "KeyToPath": "1 key s, 2 path s, 3 mode i, 4 user i",
    "NFSVolumeSource": "1 server s, 2 path s, 3 readOnly b",
    "ISCSIVolumeSource": (
        "1 targetPortal s, 2 iqn s, 3 lun i, 4 iscsiInterface s, 5 fsType s, 6 readOnly b, "
        "7 portals [s], 8 chapAuthDiscovery b, 10 secretRef LocalObjectReference, "
        "11 chapAuthSession b, 12 initiatorName s"
    ),
    "GlusterfsVolumeSource": "1 endpoints s, 2 path s, 3 readOnly b",
    "PersistentVolumeClaimVolumeSource": "1 claimName s, 2 readOnly b",
    "RBDVolumeSource": (
        "1 monitors [s], 2 image s, 3 fsType s, 4 pool s, 5 user s, 6 keyring s, "
        "7 secretRef LocalObjectReference, 8 readOnly b"
    ),
    "FlexVolumeSource": (
        "1 driver s, 2 fsType s, 3 secretRef LocalObjectReference, 4 readOnly b, 5 options {s:s}"
    ),
    "CinderVolumeSource": (
        "1 volumeID s, 2 fsType s, 3 readOnly b, 4 secretRef LocalObjectReference"
    ),
    "CephFSVolumeSource": (
        "1 monitors [s], 2 path s, 3 user s, 4 secretFile s, 5 secretRef LocalObjectReference, "
        "6 readOnly b"
    ),
    "FlockerVolumeSource": "1 datasetName s, 2 datasetUUID s",
    "DownwardAPIVolumeSource": (
        "1 items [DownwardAPIVolumeFile], 2 defaultMode i, 3 defaultUser i"
    ),
    "DownwardAPIVolumeFile": (
        "1 path s, 2 fieldRef ObjectFieldSelector, 3 resourceFieldRef ResourceFieldSelector, "
        "4 mode i, 5 user i"
    ),
    "ObjectFieldSelector": "1 apiVersion s, 2 fieldPath s",
    "ResourceFieldSelector": "1 containerName s, 2 resource s, 3 divisor Quantity",
    "FCVolumeSource": "1 targetWWNs [s], 2 lun i, 3 fsType s, 4 readOnly b, 5 wwids [s]",
    "AzureFileVolumeSource": "1 secretName s, 2 shareName s, 3 readOnly b",
    "ConfigMapVolumeSource": (
        "1 localObjectReference LocalObjectReference, 2 items [KeyToPath], 3 defaultMode i, "
        "4 optional b, 5 defaultUser i"
    ),
    "VsphereVirtualDiskVolumeSource": (
        "1 volumePath s, 2 fsType s, 3 storagePolicyName s, 4 storagePolicyID s"
    ),
    "QuobyteVolumeSource": (
        "1 registry s, 2 volume s, 3 readOnly b, 4 user s, 5 group s, 6 tenant s"
    ),
    "AzureDiskVolumeSource": (
        "1 diskName s, 2 diskURI s, 3 cachingMode s, 4 fsType s, 5 readOnly b, 6 kind s"
    ),
    "PhotonPersistentDiskVolumeSource": "1 pdID s, 2 fsType s",
    "ProjectedVolumeSource": "1 sources [VolumeProjection], 2 defaultMode i, 3 defaultUser i",
    "VolumeProjection": (
        "1 secret SecretProjection, 2 downwardAPI DownwardAPIProjection, "
        "3 configMap ConfigMapProjection, 4 serviceAccountToken ServiceAccountTokenProjection, "
        "5 clusterTrustBundle ClusterTrustBundleProjection, "
        "6 podCertificate PodCertificateProjection"
    ),
    "SecretProjection": (
        "1 localObjectReference LocalObjectReference, 2 items [KeyToPath], 4 optional b"
    ),
    "DownwardAPIProjection": "1 items [DownwardAPIVolumeFile]",
    "ConfigMapProjection": (
        "1 localObjectReference LocalObjectReference, 2 items [KeyToPath], 4 optional b"
    ),
    "ServiceAccountTokenProjection": "1 audience s, 2 expirationSeconds i, 3 path s, 4 user i",
    "ClusterTrustBundleProjection": (
        "1 name s, 2 signerName s, 3 labelSelector LabelSelector, 4 path s, 5 optional b, 6 user i"
    ),
    "PodCertificateProjection": (
        "1 signerName s, 2 keyType s, 3 maxExpirationSeconds i, 4 credentialBundlePath s, "
        "5 keyPath s, 6 certificateChainPath s, 7 userAnnotations {s:s}, 8 user i"
    ),
    "PortworxVolumeSource": "1 volumeID s, 2 fsType s, 3 readOnly b",
    "ScaleIOVolumeSource": (
        "1 gateway s, 2 system s, 3 secretRef LocalObjectReference, 4 sslEnabled b, "
        "5 protectionDomain s, 6 storagePool s, 7 storageMode s, 8 volumeName s, 9 fsType s, "
        "10 readOnly b"
    ),
    "StorageOSVolumeSource": (
        "1 volumeName s, 2 volumeNamespace s, 3 fsType s, 4 readOnly b, "
        "5 secretRef LocalObjectReference"
    ),
    "CSIVolumeSource": (
        "1 driver s, 2 readOnly b, 3 fsType s, 4 volumeAttributes {s:s}, "
        "5 nodePublishSecretRef LocalObjectReference"
    ),
    "EphemeralVolumeSource": "1 volumeClaimTemplate PersistentVolumeClaimTemplate",
    "PersistentVolumeClaimTemplate": "1 metadata ObjectMeta, 2 spec PersistentVolumeClaimSpec",
    "PersistentVolumeClaimSpec": (
        "1 accessModes [s], 2 resources VolumeResourceRequirements, 3 volumeName s, "
        "4 selector LabelSelector, 5 storageClassName s, 6 volumeMode s, "
        "7 dataSource TypedLocalObjectReference, 8 dataSourceRef TypedObjectReference, "
        "9 volumeAttributesClassName s"
    ),
    "VolumeResourceRequirements": "1 limits {s:Quantity}, 2 requests {s:Quantity}",
    "TypedLocalObjectReference": "1 apiGroup s, 2 kind s, 3 name s",
    "TypedObjectReference": "1 apiGroup s, 2 kind s, 3 name s, 4 namespace s",
    "ImageVolumeSource": "1 reference s, 2 pullPolicy s",
    "Container": CONTAINER,
    "ContainerPort": "1 name s, 2 hostPort i, 3 containerPort i, 4 protocol s, 5 hostIP s",
    "EnvFromSource": "1 prefix s, 2 configMapRef ConfigMapEnvSource, 3 secretRef SecretEnvSource",
    "ConfigMapEnvSource": "1 localObjectReference LocalObjectReference, 2 optional b",
    "SecretEnvSource": "1 localObjectReference LocalObjectReference, 2 optional b",
    "EnvVar": "1 name s, 2 value s, 3 valueFrom EnvVarSource",
    "EnvVarSource": (
        "1 fieldRef ObjectFieldSelector, 2 resourceFieldRef ResourceFieldSelector, "
        "3 configMapKeyRef ConfigMapKeySelector, 4 secretKeyRef SecretKeySelector, "
        "5 fileKeyRef FileKeySelector"
    ),
    "ConfigMapKeySelector": "1 localObjectReference LocalObjectReference, 2 key s, 3 optional b",
    "SecretKeySelector": "1 localObjectReference LocalObjectReference, 2 key s, 3 optional b",
    "FileKeySelector": "1 volumeName s, 2 path s, 3 key s, 4 optional b",
    "ResourceRequirements": (
        "1 limits {s:Quantity}, 2 requests {s:Quantity}, 3 claims [ResourceClaim]"
    ),
    "ResourceClaim": "1 name s, 2 request s",
    "ContainerResizePolicy": "1 resourceName s, 2 restartPolicy s",
    "ContainerRestartRule": "1 action s, 2 exitCodes ContainerRestartRuleOnExitCodes",
    "ContainerRestartRuleOnExitCodes": "1 operator s, 2 values [i]",
    "VolumeMount": (
        "1 name s, 2 readOnly b, 3 mountPath s, 4 subPath s, 5 mountPropagation s, "
        "6 subPathExpr s, 7 recursiveReadOnly s, 8 bindMountOptions [s]"
    ),
    "VolumeDevice": "1 name s, 2 devicePath s",
    "Probe": (
        "1 handler ProbeHandler, 2 initialDelaySeconds i, 3 timeoutSeconds i, "
        "4 periodSeconds i, 5 successThreshold i, 6 failureThreshold i, "
        "7 terminationGracePeriodSeconds i"
    ),
    "ProbeHandler": (
        "1 exec ExecAction, 2 httpGet HTTPGetAction, 3 tcpSocket TCPSocketAction, 4 grpc GRPCAction"
    ),
    "ExecAction": "1 command [s]",
    "HTTPGetAction": (
        "1 path s, 2 port IntOrString, 3 host s, 4 scheme s, 5 httpHeaders [HTTPHeader], "
        "6 protocol s"
    ),
    "HTTPHeader": "1 name s, 2 value s",
    "TCPSocketAction": "1 port IntOrString, 2 host s",
    "GRPCAction": "1 port i, 2 service s, 3 mode s",
    "Lifecycle": "1 postStart LifecycleHandler, 2 preStop LifecycleHandler, 3 stopSignal s",
    "LifecycleHandler": (
        "1 exec ExecAction, 2 httpGet HTTPGetAction, 3 tcpSocket TCPSocketAction, "
        "4 sleep SleepAction"
    ),
    "SleepAction": "1 seconds i",
    "SecurityContext": (
        "1 capabilities Capabilities, 2 privileged b, 3 seLinuxOptions SELinuxOptions, "
        "4 runAsUser i, 5 runAsNonRoot b, 6 readOnlyRootFilesystem b, "
        "7 allowPrivilegeEscalation b, 8 runAsGroup i, 9 procMount s, "
        "10 windowsOptions WindowsSecurityContextOptions, 11 seccompProfile SeccompProfile, "
        "12 appArmorProfile AppArmorProfile"
    ),
    "Capabilities": "1 add [s], 2 drop [s]",
    "SELinuxOptions": "1 user s, 2 role s, 3 type s, 4 level s",
    "WindowsSecurityContextOptions": (
        "1 gmsaCredentialSpecName s, 2 gmsaCredentialSpec s, 3 runAsUserName s, 4 hostProcess b"
    ),
    "SeccompProfile": "1 type s, 2 localhostProfile s",
    "AppArmorProfile": "1 type s, 2 localhostProfile s",
    "EphemeralContainer": (
        "1 ephemeralContainerCommon EphemeralContainerCommon, 2 targetContainerName s"
    ),
    "EphemeralContainerCommon": CONTAINER,
    "PodSecurityContext": (
        "1 seLinuxOptions SELinuxOptions, 2 runAsUser i, 3 runAsNonRoot b, "
        "4 supplementalGroups [i], 5 fsGroup i, 6 runAsGroup i, 7 sysctls [Sysctl], "
        "8 windowsOptions WindowsSecurityContextOptions, 9 fsGroupChangePolicy s, "
        "10 seccompProfile SeccompProfile, 11 appArmorProfile AppArmorProfile, "
        "12 supplementalGroupsPolicy s, 13 seLinuxChangePolicy s"
    ),
    "Sysctl": "1 name s, 2 value s",
    "Affinity": (
        "1 nodeAffinity NodeAffinity, 2 podAffinity PodAffinity, 3 podAntiAffinity PodAntiAffinity"
    ),
    "NodeAffinity": (
        "1 requiredDuringSchedulingIgnoredDuringExecution NodeSelector, "
        "2 preferredDuringSchedulingIgnoredDuringExecution [PreferredSchedulingTerm]"
    ),
    "NodeSelector": "1 nodeSelectorTerms [NodeSelectorTerm]",
    "NodeSelectorTerm": (
        "1 matchExpressions [NodeSelectorRequirement], 2 matchFields [NodeSelectorRequirement]"
    ),
    "NodeSelectorRequirement": "1 key s, 2 operator s, 3 values [s]",
    "PreferredSchedulingTerm": "1 weight i, 2 preference NodeSelectorTerm",
    "PodAffinity": (
        "1 requiredDuringSchedulingIgnoredDuringExecution [PodAffinityTerm], "
        "2 preferredDuringSchedulingIgnoredDuringExecution [WeightedPodAffinityTerm]"
    ),
    "PodAffinityTerm": (
        "1 labelSelector LabelSelector, 2 namespaces [s], 3 topologyKey s, "
        "4 namespaceSelector LabelSelector, 5 matchLabelKeys [s], 6 mismatchLabelKeys [s]"
    ),
    "WeightedPodAffinityTerm": "1 weight i, 2 podAffinityTerm PodAffinityTerm",
    "PodAntiAffinity": (
        "1 requiredDuringSchedulingIgnoredDuringExecution [PodAffinityTerm], "
        "2 preferredDuringSchedulingIgnoredDuringExecution [WeightedPodAffinityTerm]"
    ),
    "Toleration": "1 key s, 2 operator s, 3 value s, 4 effect s, 5 tolerationSeconds i",
    "HostAlias": "1 ip s, 2 hostnames [s]",
    "PodDNSConfig": "1 nameservers [s], 2 searches [s], 3 options [PodDNSConfigOption]",
    "PodDNSConfigOption": "1 name s, 2 value s",
    "PodReadinessGate": "1 conditionType s",
    "TopologySpreadConstraint": (
        "1 maxSkew i, 2 topologyKey s, 3 whenUnsatisfiable s, 4 labelSelector LabelSelector, "
        "5 minDomains i, 6 nodeAffinityPolicy s, 7 nodeTaintsPolicy s, 8 matchLabelKeys [s]"
    ),
    "PodOS": "1 name s",
    "PodSchedulingGate": "1 name s",
    "PodResourceClaim": "1 name s, 3 resourceClaimName s, 4 resourceClaimTemplateName s",
    "PodSchedulingGroup": "1 podGroupName s",
    "EvictionResponder": "1 name s, 2 priority i",
    "PodStatus": (
        "1 phase s, 2 conditions [PodCondition], 3 message s, 4 reason s, 5 hostIP s, "
        "6 podIP s, 7 startTime Time, 8 containerStatuses [ContainerStatus], 9 qosClass s, "
        "10 initContainerStatuses [ContainerStatus], 11 nominatedNodeName s, "
        "12 podIPs [PodIP], 13 ephemeralContainerStatuses [ContainerStatus], 14 resize s, "
        "15 resourceClaimStatuses [PodResourceClaimStatus], 16 hostIPs [HostIP], "
        "17 observedGeneration i, "
        "18 extendedResourceClaimStatus PodExtendedResourceClaimStatus, "
        "19 allocatedResources {s:Quantity}, 20 resources ResourceRequirements, "
        "21 nodeAllocatableResourceClaimStatuses [NodeAllocatableResourceClaimStatus], "
        "22 volumeHealth [PodVolumeHealth]"
    ),
    "PodCondition": (
        "1 type s, 2 status s, 3 lastProbeTime Time, 4 lastTransitionTime Time, 5 reason s, "
        "6 message s, 7 observedGeneration i"
    ),
    "HostIP": "1 ip s",
    "PodIP": "1 ip s",
    "ContainerStatus": (
        "1 name s, 2 state ContainerState, 3 lastState ContainerState, 4 ready b, "
        "5 restartCount i, 6 image s, 7 imageID s, 8 containerID s, 9 started b, "
        "10 allocatedResources {s:Quantity}, 11 resources ResourceRequirements, "
        "12 volumeMounts [VolumeMountStatus], 13 user ContainerUser, "
        "14 allocatedResourcesStatus [ResourceStatus], 15 stopSignal s"
    ),
    "ContainerState": (
        "1 waiting ContainerStateWaiting, 2 running ContainerStateRunning, "
        "3 terminated ContainerStateTerminated"
    ),
    "ContainerStateWaiting": "1 reason s, 2 message s",
    "ContainerStateRunning": "1 startedAt Time",
    "ContainerStateTerminated": (
        "1 exitCode i, 2 signal i, 3 reason s, 4 message s, 5 startedAt Time, "
        "6 finishedAt Time, 7 containerID s"
    ),
    "VolumeMountStatus": (
        "1 name s, 2 mountPath s, 3 readOnly b, 4 recursiveReadOnly s, 5 volumeStatus VolumeStatus"
    ),
    "VolumeStatus": "1 image ImageVolumeStatus",
    "ImageVolumeStatus": "1 imageRef s",
    "ContainerUser": "1 linux LinuxContainerUser",
    "LinuxContainerUser": "1 uid i, 2 gid i, 3 supplementalGroups [i]",
    "ResourceStatus": "1 name s, 2 resources [ResourceHealth]",
    "ResourceHealth": "1 resourceID s, 2 health s, 6 message s",
    "PodResourceClaimStatus": "1 name s, 2 resourceClaimName s",
    "PodExtendedResourceClaimStatus": (
        "1 requestMappings [ContainerExtendedResourceRequest], 2 resourceClaimName s"
    ),
    "ContainerExtendedResourceRequest": "1 containerName s, 2 resourceName s, 3 requestName s",
    "NodeAllocatableResourceClaimStatus": (
        "1 resourceClaimName s, 2 containers [s], 4 mapping [NodeAllocatableMappedResources], "
        "5 overhead [NodeAllocatableOverheadResources]"
    ),
    "NodeAllocatableMappedResources": "1 name s, 2 quantity Quantity",
    "NodeAllocatableOverheadResources": "1 name s, 2 perPod Quantity, 3 perContainer Quantity",
    "PodVolumeHealth": (
        "1 name s, 2 healthConditions [VolumeHealthCondition], 3 lastTransitionTime Time"
    ),
    "VolumeHealthCondition": "1 status s, 2 reason s, 3 message s",
    "Eviction": "1 metadata ObjectMeta, 2 deleteOptions DeleteOptions",
    "DeleteOptions": (
        "1 gracePeriodSeconds i, 2 preconditions Preconditions, 3 orphanDependents b, "
        "4 propagationPolicy s, 5 dryRun [s], "
        "6 ignoreStoreReadErrorWithClusterBreakingPotential b"
    ),
    "Preconditions": "1 uid s, 2 resourceVersion s",
}
