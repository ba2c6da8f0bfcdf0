"""What every suite shares: where things are, child processes that always get stopped, wrk and the direct-client
closed loop, the deployment under test and its request bodies, the Measurement row, the JSON and the plots."""
