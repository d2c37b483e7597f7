"""A real S3 protocol server for the tests of checkpoints on object storage: moto's server mode
(HTTP on a free port of 127.0.0.1, in a thread of the test process), which s3fs and botocore
talk to as to S3, not a mock of boto inside the process. The ranks of a launched run reach it
through the environment `s3_server` returns (dummy keys, AWS_ENDPOINT_URL, which botocore reads)."""
import contextlib
import logging
import os
from typing import Dict, Iterator


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[Dict[str, str]]:
    """Start the server with `bucket` made, set its environment in this process (and yield it, for
    launched ranks); stop it and restore the environment after."""
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request on the test's stderr
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {key: os.environ.get(key) for key in list(env) + ["AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.update(env)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):  # a developer's own profile must not be used
        os.environ.pop(key, None)
    try:
        import boto3
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
