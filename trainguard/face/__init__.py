"""What a person or a launcher touches: the command line, the timeline
report, the demo and the fault drill. The SDK is `trainguard.client`.
"""
