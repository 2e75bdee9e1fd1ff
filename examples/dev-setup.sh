#!/usr/bin/env bash
# Prepare the dev cluster (`make dev-cluster`) for examples/trainingjob.yaml:
# the `spotguard` bucket in its S3 store and the `spotguard-s3` Secret.
#   bash examples/dev-setup.sh [NAMESPACE]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=${DEV:-$ROOT/.dev}
NAMESPACE=${1:-default}
[ -f "$DEV/s3.env" ] || { echo "no dev cluster in $DEV (run: make dev-cluster)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$DEV/s3.env"
export KUBECONFIG=${KUBECONFIG:-$DEV/kubeconfig}
PATH=${SPOTGUARD_CACHE:-$HOME/.cache/spotguard}/testenv/bin:$PATH
"$ROOT/.venv/bin/python" - <<'PY'
import boto3, botocore.exceptions, os
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
try:
    s3.create_bucket(Bucket="spotguard")
    print("bucket spotguard created")
except botocore.exceptions.ClientError as exc:
    if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
        raise
    print("bucket spotguard exists")
PY
kubectl create secret generic spotguard-s3 --namespace "$NAMESPACE" \
  --from-literal=AWS_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
  --from-literal=AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" \
  --from-literal=AWS_ENDPOINT_URL="$AWS_ENDPOINT_URL_S3" \
  --dry-run=client -o yaml | kubectl apply -f -
